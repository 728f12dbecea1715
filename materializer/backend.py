"""``ChangelogKeyedStateBackend``: keyed state = a state table + a changelog + periodic snapshots.

Theory of operation
-------------------
- **Double write.** A state mutation updates the state table (heap copy-on-write maps, or LMDB)
  and appends one change record (:mod:`materializer.changes`) to this backend's
  :class:`~dstl.writer.ChangelogWriter`, in the key's key group. Before a state's first change —
  and again after every materialization starts — its metadata record goes to key group -1, so
  the log after any snapshot is self-describing.
- **Checkpoint** (:meth:`snapshot`): ``from`` = the sqn up to which the table is materialized,
  ``persist(from, cp)``; the handle = the materialized snapshot objects + the changelog handles
  after them. Only the last flush window is waited for.
- **Materialization** (:meth:`materialize_now`, or the periodic triggers): boundary
  ``up_to = writer.next_sqn()``; the table snapshot is taken on the owner thread (heap: bump the
  map versions and copy bucket arrays; LMDB: open a read transaction) and written out and uploaded
  on the ``dstl-materializer`` thread while the owner keeps writing. When it is due (a timer with
  a random first delay, then a fixed delay; a size trigger when the log since the last snapshot
  outgrows ``materialize_log_ratio`` times it — Flink triggers only on time, which let
  sliding-window jobs reach 45x space) is :mod:`materializer.policy`'s rule; the timer, the
  guards (one at a time; none until the previous one is confirmed by a completed checkpoint or
  failed), the write-batch deferral and the failure count (``max_failures`` consecutive failures
  fail the backend: the next call raises :class:`~dstl.errors.BackendFailedError` chained to the
  cause) are :class:`~materializer.manager.MaterializationManager`'s, which also holds the
  materialized base the checkpoints reference. With ``auto_materialize=False`` the backend
  never starts one by itself: its owner asks ``materialization.due()`` (the Spark task).
- **Timer thread vs owner thread.** The heap table has a single writer, so the triggers only raise
  a flag; the owner thread runs the (short) synchronous part at its next state access or
  checkpoint.
- **Truncation.** ``writer.truncate(min(materialized_up_to, subsumed_checkpoint_up_to))``: a change
  set is dropped only when it is materialized and every checkpoint that named it is subsumed.
- **Materialized elsewhere.** An on-disk (LMDB) table can be materialized by another process (the
  executor agent) from a read transaction. Each checkpoint writes a
  :class:`~materializer.table_marker.TableMarker` into the table in the same transaction as its
  state (:meth:`write_table_marker`); the snapshot carries the marker's *boundary* (the last change
  set the table reflects), and :meth:`install_materialization` makes such a snapshot this
  backend's base when its own log contains that boundary. Because metadata records are logged
  again after every checkpoint, the log after any checkpoint boundary describes its states.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import secrets
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Final

from dstl.checks import (
    check_bool,
    check_choice,
    check_instance,
    check_int,
    check_optional_path,
    check_protocol,
    check_str,
)
from dstl.errors import (
    ClosedError,
    ConfigError,
    CorruptObjectError,
    DstlError,
    KeyGroupError,
    StateError,
    StateSchemaError,
    TransientStorageError,
    UsageError,
    located,
)
from dstl.handle import ChangelogHandle, ChangeSetRef
from dstl.keygroups import MAX_PARALLELISM_LIMIT, META_KEY_GROUP, KeyGroupRange, key_group_for
from dstl.layout import operator_dir, snapshot_key
from dstl.metrics import MetricsRegistry
from dstl.options import DstlOptions
from dstl.retry import RetryBudget, RetryPolicy
from dstl.stores.base import BlobStore, check_store, translate_error
from dstl.timer import Timer, check_timer
from dstl.writer import ChangelogWriter
from materializer.changes import (
    CLEAR,
    OP_SID,
    OPS_BY_KIND,
    READS_CURRENT,
    SET,
    SET_INTERNAL,
    Change,
    apply_op,
    decode_change,
    decode_metadata,
    encode_key_ns,
    encode_metadata,
)
from materializer.codecs import (
    TTL_CODEC_PREFIX,
    BytesCodec,
    Codec,
    SafeCodec,
    StrOrBytesKeyCodec,
    TtlCodec,
    check_codec,
    codec_by_name,
    decode_hashable,
)
from materializer.compaction import FULL, MERGE, next_piece
from materializer.delta_format import DeltaEntry, DeltaMeta, DeltaReader, encode_delta
from materializer.file_snapshot import FileSnapshotMeta
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef
from materializer.local_dirs import OwnDirectory, prepare_environment
from materializer.manager import MaterializationManager, MaterializedBase
from materializer.options import BackendOptions
from materializer.policy import MaterializationRules
from materializer.replay import load_block
from materializer.schema import (
    compatibility_problems,
    compile_checker,
    conform,
    read_recorded,
    type_string,
)
from materializer.schema import record as record_schema
from materializer.states import STATE_CLASSES, KeyedState, StateDescriptor, StateShape
from materializer.table_marker import TableMarker, boundary_of
from materializer.ttl import TTL_INDEX_STATE, TtlService, new_ttl_state

__all__ = ["ChangelogKeyedStateBackend", "new_snapshot_key", "upload_snapshot"]

logger = logging.getLogger(__name__)

_pack_op_sid = OP_SID.pack
_U32_PACK = struct.Struct(">I").pack
_MAX_STATES: Final = 65536


class _NamespaceCodec:
    """Namespaces: ``None`` (the default namespace) is ``b""``; others use the safe codec (and
    must decode to something hashable: a namespace is a table key)."""

    name = "safe-ns"

    def __init__(self, max_decoded_bytes: int) -> None:
        self._safe = SafeCodec(max_decoded_bytes)

    def encode(self, ns: Any) -> bytes:
        return b"" if ns is None else self._safe.encode(ns)

    def decode(self, data: bytes) -> Any:
        return None if not data else decode_hashable(self._safe, data, "namespace")


@dataclass
class _Registered:
    state_id: int
    descriptor: StateDescriptor | None  # None: known from a restore, not yet re-registered
    shape: StateShape
    meta: dict[str, Any]
    state: KeyedState | None = None


@dataclass
class _Checkpoint:
    checkpoint_id: int
    from_sqn: int
    to_sqn: int
    materialization_id: int


class _BackendSnapshots:
    """The backend as the materialization manager's :class:`~materializer.manager.
    SnapshotSource`."""

    def __init__(self, backend: ChangelogKeyedStateBackend) -> None:
        self._b = backend

    def log_end(self) -> int:
        return int(self._b._writer.next_sqn())

    def take_snapshot(self, materialization_id: int, up_to: int
                      ) -> Callable[[], tuple[SnapshotRef, ...]]:
        b = self._b
        delta = b._delta_writer(materialization_id, up_to)
        if delta is not None:
            return delta
        full = self._full_writer(materialization_id, up_to)

        def write() -> tuple[SnapshotRef, ...]:
            try:
                ref = full()
            except BaseException:
                b._dirty = None  # the base did not change: the next one is full again
                raise
            b._chain_id = ref.materialization_id
            return (ref,)

        return write

    def _full_writer(self, materialization_id: int, up_to: int) -> Callable[[], SnapshotRef]:
        b = self._b
        snap = b._tables.snapshot()
        meta: dict[str, Any] = {
            "operator_id": b.operator_id, "materialization_id": materialization_id,
            "up_to": up_to, "states": {str(r.state_id): r.meta for r in b._by_id.values()}}
        boundary = b._boundary_at(up_to)
        if boundary is not None:
            # cut exactly at a checkpoint: every change in it was in some checkpoint's log (what
            # a change feed needs to know; the executor agent's snapshots record the same)
            meta["boundary"] = list(boundary)
        metadata = json.dumps(meta, sort_keys=True).encode("utf-8")
        b._meta_logged.clear()  # the log after up_to must describe its states again
        encode = b._encode_entry if b._heap else None
        zstd_level, store, retry = b.options.zstd_level, b._store, b._upload_retry
        max_block = b.options.max_snapshot_block_bytes
        if not b._heap and b.options.lmdb_snapshot_format == "file":
            return b._file_snapshot_writer(snap, materialization_id, up_to, boundary)

        def write() -> SnapshotRef:
            data = snap.to_bytes(metadata=metadata, encode=encode, zstd_level=zstd_level,
                                 max_block_bytes=max_block)
            key = upload_snapshot(store, b.operator_id, materialization_id, data, retry)
            return SnapshotRef(key, len(data), b.key_groups, materialization_id)

        return write

    def base_changed(self) -> None:
        self._b._maybe_truncate()


def _check_ttl_kept(meta: dict[str, Any], name: str, ttl: bool) -> None:
    """A restored state keeps its TTL-ness: its stored values have expiries, or have none.

    Raises:
        StateError: the descriptor asks for the other one (names the state and the fix).
    """
    stored = str(meta.get("value_codec") or "").startswith(TTL_CODEC_PREFIX)
    if stored == ttl:
        return
    had, asks = ("with", "without") if stored else ("without", "with")
    raise StateError(f"state {name!r} was written {had} a TTL (ttl_s) and is opened {asks} one: "
                     f"its stored values {'carry' if stored else 'have no'} expiries, and a "
                     "state's TTL cannot be switched on or off; keep the descriptor's ttl_s "
                     f"{'set' if stored else 'out'} (its value may change), or use a new state "
                     "name")


def check_layout(key_groups: object, max_parallelism: object, owner: str,
                 table: object = "heap") -> None:
    """The table kind, key groups and max parallelism of a backend (shared with
    ``restore_backend``).

    Raises:
        ConfigError: a wrong type (ConfigTypeError) or value; key groups beyond
            ``max_parallelism`` blame ``key_groups``.
    """
    check_choice(table, "table", owner, ("heap", "lmdb"))
    check_instance(key_groups, "key_groups", owner, KeyGroupRange,
                   fix="e.g. dstl.KeyGroupRange.of_operator(max_parallelism, parallelism, index)")
    check_int(max_parallelism, "max_parallelism", owner, lo=1, hi=MAX_PARALLELISM_LIMIT)
    assert isinstance(key_groups, KeyGroupRange) and isinstance(max_parallelism, int)
    if key_groups.end >= max_parallelism:
        raise ConfigError("key_groups", str(key_groups), f"a range within [0, "
                          f"{max_parallelism - 1}] (max_parallelism={max_parallelism})",
                          owner=owner)


def _check_arguments(storage: object, operator_id: object, key_groups: object,
                     max_parallelism: object, table: object, options: object,
                     key_codec: object, local_directory: object, timer: object,
                     clear_local: object, adopt_local: object,
                     auto_materialize: object) -> BackendOptions:
    """The constructor's arguments, checked before anything is opened (one place); returns the
    options to use."""
    owner = "ChangelogKeyedStateBackend"
    check_storage(storage, "storage", owner)
    check_str(operator_id, "operator_id", owner, fix="unique per backend in its storage and "
              "stable across restarts")
    check_layout(key_groups, max_parallelism, owner, table)
    if options is not None:
        check_instance(options, "options", owner, BackendOptions)
    check_codec(key_codec, "key_codec", owner)
    check_optional_path(local_directory, "local_directory", owner)
    check_timer(timer, "timer", owner)
    check_bool(clear_local, "clear_local", owner)
    check_bool(adopt_local, "adopt_local", owner)
    check_bool(auto_materialize, "auto_materialize", owner)
    return options if isinstance(options, BackendOptions) else BackendOptions()


def check_storage(storage: object, field: str, owner: str) -> None:
    """A :class:`~dstl.ChangelogStorage` (or one shaped like it: a ``store`` and
    ``create_writer``)."""
    check_protocol(storage, field, owner, ("create_writer",),
                   "a dstl.ChangelogStorage", fix="create one per process: "
                   "dstl.ChangelogStorage(uri)")
    check_store(getattr(storage, "store", None), f"{field}.store", owner)


def _check_local(operator_id: str, table: str, local_directory: str | None, clear_local: bool,
                 adopt_local: bool) -> None:
    if not adopt_local:
        return
    why = ("table='heap' has nothing on disk" if table != "lmdb"
           else "no local_directory was given (a new temporary directory holds no table)"
           if local_directory is None
           else "clear_local=True removes the table it would adopt" if clear_local else None)
    if why is not None:
        raise UsageError(f"backend {operator_id!r}: adopt_local=True opens an existing LMDB "
                         f"table, but {why}; drop adopt_local or fix the other argument")


class ChangelogKeyedStateBackend:
    """A keyed state backend whose every change is logged (see the module docstring).

    Args:
        storage: the process's :class:`~dstl.ChangelogStorage`.
        operator_id: unique per backend in the storage and stable across restarts (log id).
        key_groups: the key groups this backend owns.
        max_parallelism: number of key groups of the job.
        table: ``"heap"`` or ``"lmdb"``.
        options: :class:`~materializer.options.BackendOptions`.
        key_codec: encodes keys (default: str -> UTF-8, bytes as is).
        local_directory: where the LMDB environment lives (default: a fresh temporary directory,
            removed on close; those of killed processes are removed by the next one).
        clear_local: an existing LMDB environment of this operator is expected and removed
            (a restore). Without it one is removed too, with a warning: a new backend never
            takes over rows a previous process left (:mod:`materializer.local_dirs`).
        adopt_local: open the existing LMDB environment of this operator in ``local_directory``
            as it is, rows included — only for a caller that knows they are exactly the
            checkpoint it installs (the Spark task's adopt path checks the table marker).
        timer: timer of the periodic materialization (default: a thread of its own).
        auto_materialize: ``False``: the backend never starts a materialization by itself (no
            timer, no size trigger); its owner asks ``materialization.due()`` and calls
            :meth:`materialize_now` (the Spark task, once per batch).

    Raises:
        ConfigError: bad table kind or options.
        UsageError: the operator id is already open on this storage; ``adopt_local`` with a
            heap table, without ``local_directory`` or with ``clear_local``.
        StateError: an old LMDB environment cannot be removed.
    """

    def __init__(self, storage: Any, operator_id: str, key_groups: KeyGroupRange,
                 max_parallelism: int, table: str = "heap", options: BackendOptions | None = None,
                 *, key_codec: Codec | None = None, local_directory: str | None = None,
                 timer: Timer | None = None, clear_local: bool = False,
                 adopt_local: bool = False, auto_materialize: bool = True) -> None:
        self.options = _check_arguments(storage, operator_id, key_groups, max_parallelism,
                                        table, options, key_codec, local_directory, timer,
                                        clear_local, adopt_local, auto_materialize)
        _check_local(operator_id, table, local_directory, clear_local, adopt_local)
        self.operator_id = operator_id
        self.key_groups = key_groups
        self.max_parallelism = max_parallelism
        self.table_kind = table
        self._storage = storage
        self._store = storage.store
        # snapshot uploads retry like segment uploads (the storage's options)
        self._upload_retry = RetryPolicy.for_uploads(getattr(storage, "options", None)
                                                     or DstlOptions())
        self._heap = table == "heap"
        self._key_codec: Codec = key_codec or StrOrBytesKeyCodec()
        self._ns_codec = _NamespaceCodec(self.options.max_value_decoded_bytes)
        rules = MaterializationRules.of(self.options)  # may refuse the options: before opening
        self._own_dir: OwnDirectory | None = None
        self._tables: Any = None
        # the writer first: it refuses an operator id that is live in this storage before any
        # local table of that operator is touched
        self._writer: ChangelogWriter = storage.create_writer(operator_id, key_groups)
        try:
            self._tables = self._open_tables(local_directory, clear_local, adopt_local)
            # the table's incarnation (materializer.table_marker): kept when adopting the table,
            # new when the table is created or restored
            self._table_id = (self._adopted_table_id() if adopt_local else "") or \
                secrets.token_hex(8)
            self._init_state(rules, timer, auto_materialize)
        except BaseException:
            self._abandon()
            raise
        logger.info("backend %s opened: %s table, key groups %s", operator_id, table, key_groups)

    def _init_state(self, rules: MaterializationRules, timer: Timer | None,
                    auto_materialize: bool) -> None:
        operator_id = self.operator_id
        self._metrics = MetricsRegistry(f"ChangelogBackend.{operator_id}.")
        self._lock = threading.Lock()  # checkpoint bookkeeping shared with the materializer
        self._reset_cursor()
        # states
        self._states: dict[str, _Registered] = {}
        self._by_id: dict[int, _Registered] = {}
        self._raw: set[int] = set()  # raw states (internal indexes): no codecs applied
        self._ttl: TtlService | None = None  # with the first TTL state (materializer.ttl)
        self._ttl_time: int | None = None
        self._meta_logged: set[int] = set()
        # checkpoints
        self._last_checkpoint: _Checkpoint | None = None
        self._checkpoint_up_to: dict[int, tuple[int, int]] = {}  # cp -> (to_sqn, mat id)
        self._pending_from: dict[int, int] = {}  # in-flight checkpoint -> its from_sqn
        self._subsumed_up_to: int | None = None
        #: the log part of the newest checkpoint that this backend's writer produced
        self.last_delta: ChangelogHandle | None = None
        #: (to_sqn, boundary) of the newest durable checkpoint (see _boundary_at)
        self._checkpoint_boundary: tuple[int, tuple[str, int] | None] | None = None
        self._non_mat_sizes = {"lastFullSizeOfNonMaterialization": 0.0,
                               "lastIncSizeOfNonMaterialization": 0.0}
        for name in self._non_mat_sizes:
            self._metrics.gauge(name, lambda n=name: self._non_mat_sizes[n])  # type: ignore[misc]
        self._closed = False
        self._attention = False  # the materialization manager wants the owner thread
        # incremental materialization: the entries changed since the last materialization's cut
        # ((key group, state id, key bytes, namespace bytes) -> the table's key and namespace),
        # or None when not known (off, too many, after a failed materialization); and the id of
        # the newest piece this backend wrote itself (a delta only continues its own chain)
        self._dirty: dict[tuple[int, int, bytes, bytes], tuple[Any, Any]] | None = (
            {} if self.options.incremental_snapshots else None)
        self._chain_id = -1
        self._max_dirty = self.options.max_delta_entries
        self._mat = MaterializationManager(
            operator_id, rules, _BackendSnapshots(self), self._metrics, wake=self._wake,
            timer=timer, automatic=auto_materialize, defer_in_batch=not self._heap)

    def _adopted_table_id(self) -> str:
        """The ``table_id`` of the adopted table's marker (``""``: none, or unreadable — the
        caller checks the marker itself before using the table)."""
        raw = self._tables.read_marker()
        if raw is None:
            return ""
        try:
            return TableMarker.from_bytes(raw).table_id
        except CorruptObjectError:
            return ""

    def _abandon(self) -> None:
        """A constructor failed midway: release what it opened (log id, table, own directory)."""
        self._writer.close()
        if self._tables is not None:
            self._tables.close()
        if self._own_dir is not None:
            self._own_dir.remove()

    def _open_tables(self, local_directory: str | None, clear_local: bool,
                     adopt_local: bool) -> Any:
        if self._heap:
            from materializer.state_tables import HeapStateTables
            return HeapStateTables(self.key_groups)
        from materializer import lmdb_table
        if local_directory is None:
            self._own_dir = OwnDirectory.create()
            local_directory = self._own_dir.path
        env_dir = os.path.join(local_directory, operator_dir(self.operator_id))
        prepare_environment(env_dir, adopt=adopt_local, expected=clear_local,
                            owner=repr(self.operator_id))
        return lmdb_table.LmdbStateTable(env_dir, self.key_groups,
                                         map_size_bytes=self.options.lmdb_map_size_bytes,
                                         max_map_size_bytes=self.options.lmdb_max_map_size_bytes)

    def _file_snapshot_writer(self, snap: Any, materialization_id: int, up_to: int,
                              boundary: tuple[str, int] | None = None
                              ) -> Callable[[], SnapshotRef]:
        """The write-out of a file-level snapshot (format v2) of the LMDB table from ``snap``'s
        read transaction (:func:`~materializer.lmdb_files.spool_table_snapshot`: the copy
        streamed into the compressor, packed first when the pages are far from full, the object
        spooled beside the table and read for the upload once the read transaction ended).
        ``boundary``: the last change set the copy reflects, when the cut is exactly at a
        checkpoint (as in v1)."""
        meta = FileSnapshotMeta(self.key_groups, self.max_parallelism,
                                {str(r.state_id): r.meta for r in self._by_id.values()},
                                self.operator_id, materialization_id, boundary=boundary,
                                extra={"up_to": up_to})
        tmp_dir = os.path.dirname(self._tables.path)
        zstd_level, store, retry = self.options.zstd_level, self._store, self._upload_retry

        def write() -> SnapshotRef:
            from materializer.lmdb_files import spool_table_snapshot
            try:
                spool = spool_table_snapshot(snap, meta, tmp_dir, zstd_level=zstd_level)
            finally:
                snap.release()
            with spool:
                data = spool.read()
            key = upload_snapshot(store, self.operator_id, materialization_id, data, retry)
            return SnapshotRef(key, len(data), self.key_groups, materialization_id)

        return write

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
        o = self.options
        if not o.incremental_snapshots:
            return None
        dirty, self._dirty = self._dirty, {}  # later changes belong to the next cut
        base = self._mat.base
        chain = base.snapshots
        if (dirty is None or not chain or base.restored_log or chain[0].delta
                or base.materialization_id != self._chain_id
                or any(p.key_groups != self.key_groups for p in chain)):
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
                               "this materialization is full", self.operator_id, exc)
                return None
        blocks: dict[int, list[tuple[int, bytes, bytes, bytes | None]]] = {}
        get = self._tables.get
        for (kg, sid, kb, nb), (tk, tn) in dirty.items():
            v = get(sid, kg, tk, tn)
            if v is None:
                value = None
            elif self._heap and sid not in self._raw:
                value = self._by_id[sid].shape.to_bytes(v)
            else:
                value = bytes(v)
            blocks.setdefault(kg, []).append((sid, kb, nb, value))
        for entries in blocks.values():
            entries.sort(key=lambda e: (e[0], e[1], e[2]))
        meta = DeltaMeta(self.key_groups, self.max_parallelism, self.operator_id,
                         materialization_id, follows[-1].materialization_id, up_to,
                         {str(r.state_id): r.meta for r in self._by_id.values()})
        self._meta_logged.clear()  # the log after up_to must describe its states again
        zstd_level, store, retry = o.zstd_level, self._store, self._upload_retry
        max_block = o.max_snapshot_block_bytes

        def write() -> tuple[SnapshotRef, ...]:
            try:
                data = encode_delta(meta, sorted(blocks.items()), zstd_level=zstd_level,
                                    max_block_bytes=max_block)
                key = upload_snapshot(store, self.operator_id, materialization_id, data, retry)
            except BaseException:
                self._dirty = None  # these changes are in no piece: the next one is full
                raise
            self._chain_id = materialization_id
            return (*follows, SnapshotRef(key, len(data), self.key_groups, materialization_id,
                                          delta=True))

        return write

    def _add_delta_entries(self, pieces: Iterable[SnapshotRef],
                           into: dict[tuple[int, int, bytes, bytes], tuple[Any, Any]]) -> None:
        """Add the entries of this backend's own delta objects ``pieces`` (read from the store)
        to the changed entries ``into``, in the table's key forms."""
        o = self.options
        for piece in pieces:
            reader = DeltaReader(self._store.get(piece.key), key=piece.key,
                                 max_block_bytes=o.max_snapshot_block_bytes)
            for kg, _at, entries in reader.read():
                for sid, kb, nb, _v in entries:
                    if (kg, sid, kb, nb) in into:
                        continue
                    if self._heap and sid not in self._raw:
                        into[(kg, sid, kb, nb)] = (self._key_codec.decode(kb),
                                                   self._ns_codec.decode(nb))
                    else:
                        into[(kg, sid, kb, nb)] = (kb, nb)

    def replace_table(self, directory: str) -> None:
        """Restore only, before any state access: make the checked LMDB environment in
        ``directory`` (on the table's filesystem; see :mod:`restore.file_restore`) this
        backend's table. The (empty) table is closed, the environment renamed into its place —
        the rename is the commit point: before it the old directory is in place, after it the
        new one — and opened.

        Raises:
            UsageError: the table is the heap.
        """
        if self._heap:
            raise UsageError(f"backend {self.operator_id!r}: a heap table has no directory")
        path = self._tables.path
        self._tables.close()
        # named like a restore's staging directories, so a restore killed between the two
        # renames leaves debris the next restore removes (restore.file_restore)
        old = os.path.join(os.path.dirname(path),
                           f".dstl-stage-{os.getpid()}-old-{secrets.token_hex(4)}")
        with contextlib.suppress(FileNotFoundError):
            os.rename(path, old)
        os.rename(directory, path)
        shutil.rmtree(old, ignore_errors=True)
        from materializer.lmdb_table import LmdbStateTable
        self._tables = LmdbStateTable(path, self.key_groups,
                                      map_size_bytes=self.options.lmdb_map_size_bytes,
                                      max_map_size_bytes=self.options.lmdb_max_map_size_bytes)

    def _reset_cursor(self) -> None:
        """No current key; the default namespace."""
        self._key: Any = None
        self._kg = -2
        self._key_b = b""
        self._ns: Any = None
        self._ns_b = b""
        self._kn = encode_key_ns(b"", b"")
        self._tk: Any = None
        self._tn: Any = None if self._heap else b""

    # ------------------------------------------------------------------ key / namespace

    def set_current_key(self, key: Any) -> None:
        """Set the key that state calls refer to.

        Raises:
            KeyGroupError: the key's key group is not owned by this backend.
            UsageError: the key codec cannot encode the key.
        """
        if self._attention:
            self._attend()
        kb = self._key_codec.encode(key)
        kg = key_group_for(kb, self.max_parallelism)
        if not self.key_groups.start <= kg <= self.key_groups.end:
            raise KeyGroupError(kg, f"backend {self.operator_id!r}", self.key_groups,
                                f"key {key!r} belongs to another backend; route by "
                                "dstl.key_group_for")
        self._key, self._key_b, self._kg = key, kb, kg
        self._kn = encode_key_ns(kb, self._ns_b)
        self._tk = key if self._heap else kb

    def get_current_key(self) -> Any:
        return self._key

    @property
    def current_key_bytes(self) -> bytes:
        """The current key as the key codec encodes it.

        Raises:
            UsageError: no current key.
        """
        if self._kg < 0:
            self.before_read()
        return bytes(self._key_b)

    @property
    def current_key_group(self) -> int:
        """The key group of the current key.

        Raises:
            UsageError: no current key.
        """
        if self._kg < 0:
            self.before_read()
        return self._kg

    def set_current_namespace(self, namespace: Any) -> None:
        """Set the namespace (e.g. a window); ``None`` is the default namespace."""
        nb = self._ns_codec.encode(namespace)
        self._ns, self._ns_b = namespace, nb
        self._kn = encode_key_ns(self._key_b, nb)
        self._tn = namespace if self._heap else nb

    @property
    def current_namespace(self) -> Any:
        return self._ns

    @property
    def current_namespace_bytes(self) -> bytes:
        return bytes(self._ns_b)

    @property
    def has_current_key(self) -> bool:
        return self._kg >= 0

    # ------------------------------------------------------------------ TTL

    def set_ttl_time(self, now_ms: int | None) -> None:
        """Fix the clock of the TTL states at ``now_ms`` (epoch ms; the Spark task sets the
        batch's processing time); ``None``: the wall clock at each call."""
        if self._ttl is not None:
            self._ttl.set_time(now_ms)
        elif now_ms is not None and (type(now_ms) is not int or now_ms < 0):
            raise UsageError(f"TTL time {now_ms!r} must be an int of epoch milliseconds >= 0")
        self._ttl_time = now_ms

    def ttl_service(self) -> TtlService | None:
        """The TTL service (:mod:`materializer.ttl`): made with the first TTL state, or when a
        restore brought an expiry index; ``None`` when this backend has neither."""
        if self._ttl is None and TTL_INDEX_STATE in self._states:
            self._ttl = TtlService(self)
            self._ttl.set_time(self._ttl_time)
        return self._ttl

    def purge_expired(self, now_ms: int | None = None) -> int:
        """Remove (logged) the TTL values expired at ``now_ms`` (default: the TTL clock);
        returns how many were removed (see :mod:`materializer.ttl`)."""
        self._check_open()
        svc = self.ttl_service()
        return 0 if svc is None else svc.purge(now_ms)

    # ------------------------------------------------------------------ states

    def get_state(self, descriptor: StateDescriptor) -> Any:
        """Register (or look up) the state described by ``descriptor`` and return it.

        Raises:
            UsageError: a state of that name exists with another kind, or too many states.
        """
        self._check_open()
        if not isinstance(descriptor, StateDescriptor) or descriptor.kind not in STATE_CLASSES:
            raise UsageError(f"not a state descriptor: {descriptor!r}")
        if not isinstance(descriptor.name, str) or not 0 < len(descriptor.name) <= 255:
            raise UsageError(f"state name {descriptor.name!r} is invalid: expected a non-empty "
                             "string of at most 255 characters")
        reg = self._states.get(descriptor.name)
        if reg is not None and reg.state_id in self._raw:
            raise UsageError(f"state {descriptor.name!r} is an internal index of backend "
                             f"{self.operator_id!r}; choose another state name")
        ttl = descriptor.ttl_s is not None
        if reg is not None and reg.state is not None:
            if reg.meta["kind"] != descriptor.kind:
                raise UsageError(f"state {descriptor.name!r} is a {reg.meta['kind']} state; it "
                                 f"cannot be opened as a {descriptor.kind} state")
            if isinstance(reg.shape.codec, TtlCodec) != ttl:
                raise UsageError(f"state {descriptor.name!r} is open "
                                 f"{'with' if not ttl else 'without'} a TTL; it cannot be "
                                 f"opened {'with' if ttl else 'without'} one in the same backend")
            return reg.state
        if reg is not None and reg.meta["kind"] != descriptor.kind:
            raise UsageError(f"state {descriptor.name!r} was restored as a {reg.meta['kind']} "
                             f"state; it cannot be opened as a {descriptor.kind} state")
        # The safe codec by default, with this backend's decoded-size limit.
        limit = self.options.max_value_decoded_bytes
        codec = descriptor.serializer if descriptor.serializer is not None else SafeCodec(limit)
        key_codec = None
        if descriptor.kind == "map":
            given = getattr(descriptor, "key_serializer", None)
            key_codec = given if given is not None else SafeCodec(limit)
        if reg is not None:
            _check_ttl_kept(reg.meta, descriptor.name, ttl)
        if ttl:
            codec = TtlCodec(codec)
        shape = StateShape(descriptor.kind, codec, key_codec)
        meta = {"name": descriptor.name, "kind": descriptor.kind, "value_codec": codec.name,
                "key_codec": key_codec.name if key_codec is not None else None}
        if descriptor.schema is not None:
            meta["schema"] = record_schema(descriptor.schema)
            if reg is not None:
                self._adopt_declared_type(reg, shape, descriptor.schema, meta)
        if reg is None:
            if len(self._by_id) >= _MAX_STATES:
                raise UsageError(f"backend {self.operator_id!r} has {_MAX_STATES} states; no "
                                 "more can be registered")
            sid = max(self._by_id, default=-1) + 1
            reg = _Registered(sid, descriptor, shape, meta)
            self._states[descriptor.name] = reg
            self._by_id[sid] = reg
        else:
            if reg.meta != meta:
                self._meta_logged.discard(reg.state_id)  # the log must describe it anew
            reg.descriptor, reg.shape, reg.meta = descriptor, shape, meta
        reg.state = self._new_state(reg.state_id, descriptor, shape)
        return reg.state

    def _adopt_declared_type(self, reg: _Registered, shape: StateShape, declared: Any,
                             meta: dict[str, Any]) -> None:
        """Open a restored state under the type now declared for it (rules 2 and 3 of
        :mod:`materializer.schema`). Recorded and declared alike: nothing to do. Recorded
        ``R`` and declared ``D`` compatible: every stored value is converted to ``D`` and
        rewritten (logged, like any write) where the conversion changed it. Nothing recorded
        (the state was undeclared): every stored value is checked against ``D``.

        Raises:
            StateSchemaError: ``D`` cannot read values of ``R``, or a stored value does not fit
                ``D`` (names the state, both types, and the key).
        """
        name = str(reg.meta["name"])
        raw = reg.meta.get("schema")
        recorded = read_recorded(raw) if raw is not None else None
        if recorded == declared:
            return
        shown = type_string(recorded) if recorded is not None else None
        if recorded is not None:
            problems = compatibility_problems(recorded, declared)
            if problems:
                raise StateSchemaError(name, shown, type_string(declared), problems,
                                       f"backend {self.operator_id!r}")
        reg.meta = meta  # the rewrites below are logged after the new description
        self._meta_logged.discard(reg.state_id)
        check = compile_checker(declared)
        pair = shape.codec.name.startswith(TTL_CODEC_PREFIX)
        kind = shape.kind
        sid = reg.state_id
        rewritten = 0

        def fit(v: Any, key: Any) -> tuple[Any, bool]:
            unit = v[1] if pair else v
            new, changed = conform(unit, declared) if recorded is not None else (unit, False)
            why = check(new) if new is not None else "null"
            if why is not None:
                if not self._heap:
                    key = self._key_codec.decode(bytes(key))
                raise StateSchemaError(name, shown, type_string(declared),
                                       [f"key {key!r:.80}: a {type(unit).__name__} ({why})"],
                                       f"backend {self.operator_id!r}")
            return ((v[0], new) if pair else new), changed

        for kg in range(self.key_groups.start, self.key_groups.end + 1):
            for key, ns, stored in list(self._tables.entries(sid, kg)):
                obj = stored if self._heap else shape.from_bytes(stored)
                if kind == "list":
                    units = [fit(u, key) for u in obj]
                    new_obj: Any = [u for u, _ in units]
                    changed = any(c for _, c in units)
                elif kind == "map":
                    entries = {k: fit(u, key) for k, u in obj.items()}
                    new_obj = {k: u for k, (u, _) in entries.items()}
                    changed = any(c for _, c in entries.values())
                else:
                    new_obj, changed = fit(obj, key)
                if not changed:
                    continue
                encoded = shape.to_bytes(new_obj)
                self._tables.put(sid, kg, key, ns, new_obj if self._heap else encoded)
                if self._heap:
                    kb, nb = self._key_codec.encode(key), self._ns_codec.encode(ns)
                else:
                    kb, nb = bytes(key), bytes(ns)
                self._log_raw(SET if kind == "value" else SET_INTERNAL, sid, kg, kb, nb,
                              encoded, key, ns)
                rewritten += 1
        logger.info("state %r of backend %r: declared type %s over recorded %s; %d values "
                    "converted", name, self.operator_id, type_string(declared), shown, rewritten)

    def _new_state(self, sid: int, descriptor: StateDescriptor, shape: StateShape) -> KeyedState:
        """The state object of ``descriptor`` (a TTL state with ``ttl_s``)."""
        if descriptor.ttl_s is None:
            return STATE_CLASSES[descriptor.kind](self, sid, descriptor, shape)
        if self._ttl is None:
            self._ttl = TtlService(self)
            self._ttl.set_time(self._ttl_time)
        return new_ttl_state(self, sid, descriptor, shape, self._ttl, descriptor.ttl_s)

    def state_names(self) -> list[str]:
        return sorted(self._states)

    def internal_state_ids(self) -> list[int]:
        """Ids of the states that are DSTL's own, not the user's: the raw indexes and the
        states whose name starts with ``$`` (the timer service's)."""
        return sorted(sid for sid, reg in self._by_id.items()
                      if sid in self._raw or str(reg.meta["name"]).startswith("$"))

    def delete_state_entries(self, name: str) -> int:
        """Remove every entry of state ``name`` — all keys and namespaces of this backend —
        and return how many (no such state: 0). Each removal is logged as a ``CLEAR`` of its
        key and namespace, so a replay removes the same entries. The state stays registered:
        ``get_state`` opens it again, empty (Spark's ``deleteIfExists``).

        Raises:
            UsageError: ``name`` is an internal index (raw state).
        """
        self._check_open()
        reg = self._states.get(name)
        if reg is None:
            return 0
        sid = reg.state_id
        if sid in self._raw:
            raise UsageError(f"state {name!r} is an internal index of backend "
                             f"{self.operator_id!r}; it cannot be deleted")
        if self._attention:
            self._attend()
        removed = 0
        for kg in range(self.key_groups.start, self.key_groups.end + 1):
            for key, ns, _ in list(self._tables.entries(sid, kg)):
                if self._heap:  # the heap table holds objects; the log holds their encodings
                    kb, nb = self._key_codec.encode(key), self._ns_codec.encode(ns)
                else:
                    kb, nb = bytes(key), bytes(ns)
                self._tables.remove(sid, kg, key, ns)
                self._log_raw(CLEAR, sid, kg, kb, nb, b"", key, ns)
                removed += 1
        return removed

    def state_metadata(self) -> dict[int, dict[str, Any]]:
        """Every registered state by id: its metadata (``name``, ``kind``, ``value_codec``,
        ``key_codec``), as recorded in snapshots and metadata records (a copy)."""
        return {sid: dict(r.meta) for sid, r in sorted(self._by_id.items())}

    # ------------------------------------------------------------------ StateAccess (the states)
    # materializer.states.StateAccess: how the state objects reach the table and the log.

    def before_read(self) -> None:
        """Run pending work; raise ``UsageError`` when no current key is set."""
        if self._attention:
            self._attend()
        if self._kg < 0:
            raise UsageError(f"backend {self.operator_id!r}: set_current_key() first")

    def read_state(self, sid: int, shape: StateShape) -> Any:
        """The current key and namespace's value of state ``sid`` (decoded), or ``None``."""
        if self._kg < 0:
            self.before_read()
        v = self._tables.get(sid, self._kg, self._tk, self._tn)
        if v is None or self._heap:
            return v
        try:
            return shape.from_bytes(v)
        except CorruptObjectError as exc:
            raise self._stored_value_error(exc, sid, f"key {self._key!r:.80}, key group "
                                                    f"{self._kg}") from exc

    def _stored_value_error(self, exc: CorruptObjectError, sid: int, where: str) -> DstlError:
        """A value of the LMDB table that does not decode (the table holds restored values as
        stored, undecoded), named by the table and the objects its state came from."""
        base = self._mat.base
        origin = [s.key for s in base.snapshots]
        origin += list(dict.fromkeys(r.key for h in base.restored_log for r in h.change_sets))
        came = (f"; its state came from {', '.join(origin[:4])}"
                f"{f' and {len(origin) - 4} more' if len(origin) > 4 else ''}" if origin else "")
        return located(exc, f"{self._tables.path} (LMDB table{came})", 0,
                       f"value of state {self._by_id[sid].meta['name']!r}, {where}")

    def read_state_raw(self, sid: int) -> Any:
        """The table's stored form (LMDB: bytes) without decoding."""
        if self._kg < 0:
            self.before_read()
        return self._tables.get(sid, self._kg, self._tk, self._tn)

    def before_mutation(self) -> None:
        """Before an in-place mutation of a live heap object: honour flags like a write."""
        if self._attention:
            self._attend()

    def write_state(self, sid: int, value: Any) -> None:
        """Store ``value`` (the table's stored form) for the current key and namespace."""
        if self._attention:
            self._attend()
        if self._kg < 0:
            self.before_read()
        self._tables.put(sid, self._kg, self._tk, self._tn, value)

    def write_state_object(self, sid: int, shape: StateShape, obj: Any) -> None:
        """Store the heap object ``obj`` (encoded with ``shape`` for LMDB)."""
        self.write_state(sid, obj if self._heap else shape.to_bytes(obj))

    def remove_state(self, sid: int) -> None:
        """Remove the current key and namespace's value of state ``sid``."""
        if self._attention:
            self._attend()
        if self._kg < 0:
            self.before_read()
        self._tables.remove(sid, self._kg, self._tk, self._tn)

    def log_change(self, op: int, sid: int, payload: bytes) -> None:
        """Append one change record of the current key and namespace to the log."""
        if sid not in self._meta_logged:
            self._log_metadata(sid)
        data = _pack_op_sid(op, sid) + self._kn + payload
        self._writer.append(self._kg, data)
        self._mat.note_log(len(data))
        dirty = self._dirty
        if dirty is not None:  # inline: the hot path of every write (_touch's job)
            dirty[(self._kg, sid, self._key_b, self._ns_b)] = (self._tk, self._tn)
            if len(dirty) > self._max_dirty:
                self._dirty = None

    def _touch(self, kg: int, sid: int, kb: bytes, nb: bytes, tk: Any, tn: Any) -> None:
        """Remember a changed entry for the next delta (``log_change``, the hot path, does the
        same inline)."""
        dirty = self._dirty
        if dirty is None:
            return
        dirty[(kg, sid, kb, nb)] = (tk, tn)
        if len(dirty) > self._max_dirty:
            self._dirty = None  # the next materialization is a full one

    def _log_metadata(self, sid: int) -> None:
        self._writer.append(META_KEY_GROUP, encode_metadata(sid, self._by_id[sid].meta))
        self._meta_logged.add(sid)

    def merge_state_namespaces(self, sid: int, shape: StateShape, target: Any,
                               sources: Iterable[Any], fn: Callable[[Any, Any], Any]) -> None:
        """Merge the namespaces ``sources`` into ``target`` for the current key; logged as
        CLEAR of each source and SET_INTERNAL of the target (replay runs no merge function)."""
        saved = self._ns
        try:
            merged = None
            self.set_current_namespace(target)
            merged = self.read_state(sid, shape)
            for src in sources:
                if src == target:
                    continue
                self.set_current_namespace(src)
                v = self.read_state(sid, shape)
                if v is None:
                    continue
                merged = v if merged is None else fn(merged, v)
                self.remove_state(sid)
                self.log_change(CLEAR, sid, b"")
            if merged is not None:
                self.set_current_namespace(target)
                encoded = shape.to_bytes(merged)
                self.write_state(sid, shape.from_bytes(encoded) if self._heap else encoded)
                self.log_change(SET_INTERNAL, sid, encoded)
        finally:
            self.set_current_namespace(saved)

    # ------------------------------------------------------------------ raw states
    # Internal indexes (the timer service's time index, materializer/timers.py): entries at an
    # explicit key group with raw key, namespace and value bytes. They are logged, snapshotted,
    # restored and rescaled like every state, but no codec touches them, so the index chooses
    # its own byte order (LMDB keeps a key group's entries sorted by key bytes).

    def register_raw_state(self, name: str) -> int:
        """Register (or look up) the raw state ``name``; returns its state id.

        Raises:
            UsageError: a state of that name exists and is not raw, or too many states.
        """
        self._check_open()
        reg = self._states.get(name)
        if reg is not None:
            if reg.state_id not in self._raw:
                raise UsageError(f"state {name!r} of backend {self.operator_id!r} is a "
                                 f"{reg.meta['kind']} state, not an internal index")
            return reg.state_id
        if len(self._by_id) >= _MAX_STATES:
            raise UsageError(f"backend {self.operator_id!r} has {_MAX_STATES} states; no "
                             "more can be registered")
        sid = max(self._by_id, default=-1) + 1
        meta = {"name": name, "kind": "value", "value_codec": BytesCodec.name,
                "key_codec": None, "raw": True}
        reg = _Registered(sid, None, StateShape("value", BytesCodec()), meta)
        self._states[name] = reg
        self._by_id[sid] = reg
        self._raw.add(sid)
        return sid

    def _raw_check(self, sid: int, key_group: int) -> None:
        self._check_open()
        if self._attention:
            self._attend()
        if sid not in self._raw:
            raise UsageError(f"state id {sid} of backend {self.operator_id!r} is not a raw state")
        if type(key_group) is not int or key_group not in self.key_groups:
            raise KeyGroupError(key_group, f"backend {self.operator_id!r}", self.key_groups,
                                "a raw entry lives in a key group of its backend")

    def raw_put(self, sid: int, key_group: int, key: bytes, namespace: bytes,
                value: bytes) -> None:
        """Store and log a raw entry."""
        self._raw_check(sid, key_group)
        self._tables.put(sid, key_group, key, namespace, value)
        self._log_raw(SET, sid, key_group, key, namespace, value)

    def raw_remove(self, sid: int, key_group: int, key: bytes, namespace: bytes) -> bool:
        """Remove a raw entry (logged when it existed); whether it existed."""
        self._raw_check(sid, key_group)
        if not self._tables.remove(sid, key_group, key, namespace):
            return False
        self._log_raw(CLEAR, sid, key_group, key, namespace, b"")
        return True

    def raw_get(self, sid: int, key_group: int, key: bytes, namespace: bytes) -> bytes | None:
        """A raw entry's value, or ``None``."""
        self._raw_check(sid, key_group)
        v = self._tables.get(sid, key_group, key, namespace)
        return None if v is None else bytes(v)

    def raw_entries(self, sid: int, key_group: int) -> Iterator[tuple[bytes, bytes, bytes]]:
        """``(key, namespace, value)`` of a raw state in one key group (LMDB: sorted by key
        bytes; heap: in no particular order)."""
        self._raw_check(sid, key_group)
        return iter(list(self._tables.entries(sid, key_group)))

    def _log_raw(self, op: int, sid: int, key_group: int, key: bytes, namespace: bytes,
                 payload: bytes, table_key: Any = None, table_ns: Any = None) -> None:
        """Log a change given by its bytes; ``table_key``/``table_ns``: the table's key and
        namespace when they are not those bytes (a heap state's objects)."""
        if sid not in self._meta_logged:
            self._log_metadata(sid)
        data = _pack_op_sid(op, sid) + encode_key_ns(key, namespace) + payload
        self._writer.append(key_group, data)
        self._mat.note_log(len(data))
        if self._dirty is not None:
            self._touch(key_group, sid, bytes(key), bytes(namespace),
                        key if table_key is None else table_key,
                        namespace if table_ns is None else table_ns)

    # ------------------------------------------------------------------ restore hooks

    def apply_change(self, key_group: int, payload: bytes, *, remap: dict[int, int] | None = None,
                     allow_pickle: bool = False) -> None:
        """Apply one logged change to the table WITHOUT logging it again (used by restore).

        A metadata record (key group -1) registers its state and, when ``remap`` is given, maps
        the log's state id to this backend's id for that name (backends being merged by a
        rescale may have numbered their states differently). The restore hands over only the
        changes of key groups this backend owns (it filters while reading); one of another key
        group is corruption, never skipped: skipping would hide a wrong plan or reader.

        Raises:
            CorruptObjectError: malformed record, a change before its state's metadata, or a
                change of a key group outside this backend's range.
            StateError: the log names a state with a different kind than this backend knows.
        """
        if key_group == META_KEY_GROUP:
            sid, meta = decode_metadata(payload)
            new = self.register_restored_state(meta, sid, allow_pickle=allow_pickle)
            if remap is not None:
                remap[sid] = new
            return
        if not self.key_groups.start <= key_group <= self.key_groups.end:
            raise CorruptObjectError("<changelog>", 0, f"a change of key group {key_group} was "
                                                       f"handed to backend {self.operator_id!r}, "
                                                       f"which owns {self.key_groups}")
        ch = decode_change(payload)
        sid = ch.state_id if remap is None else remap.get(ch.state_id, -1)
        reg = self._by_id.get(sid)
        if reg is None:
            raise CorruptObjectError("<change>", 1, f"change for state id {ch.state_id} "
                                                    "before its metadata record")
        if ch.op not in OPS_BY_KIND[reg.shape.kind]:
            raise CorruptObjectError("<change>", 0, f"op {ch.op} is not an operation of "
                                                    f"{reg.shape.kind} state {reg.meta['name']!r}")
        self._apply(key_group, reg, ch)

    def is_raw_state(self, state_id: int) -> bool:
        """Whether ``state_id`` is a raw state (bytes in, bytes stored; no codec)."""
        return state_id in self._raw

    def registered_state(self, state_id: int) -> _Registered | None:
        """The registration of this backend's ``state_id`` (its shape and metadata), if any."""
        return self._by_id.get(state_id)

    @property
    def key_codec(self) -> Codec:
        """How this backend encodes keys."""
        return self._key_codec

    @property
    def namespace_codec(self) -> Any:
        """How this backend encodes namespaces (``None`` is ``b""``)."""
        return self._ns_codec

    def bulk_restore(self) -> contextlib.AbstractContextManager[Any]:
        """The write batch of a restore's bulk replay: LMDB's
        :class:`~materializer.lmdb_table.LmdbBulkLoad` (commits as it goes), ``None`` for the
        heap (writes are immediate). See :mod:`materializer.replay`."""
        if self._heap:
            return contextlib.nullcontext(None)
        return self._tables.bulk_load()  # type: ignore[no-any-return]

    def register_restored_state(self, meta: dict[str, Any], preferred_id: int, *,
                                allow_pickle: bool = False) -> int:
        """Register a state known from a snapshot or the log; return its id in this backend.

        The state keeps ``preferred_id`` when that id is free; a state of the same name keeps
        the id it already has.

        Raises:
            StateError: same name, different kind; or an unknown kind.
            UsageError: its codec is not built in (or is pickle without ``allow_pickle``).
        """
        name = meta.get("name")
        kind = meta.get("kind")
        if not isinstance(name, str) or not isinstance(kind, str) or kind not in STATE_CLASSES:
            raise StateError(f"state metadata {str(meta)[:200]} has no valid name/kind")
        existing = self._states.get(name)
        if existing is not None:
            if existing.meta["kind"] != kind:
                raise StateError(f"state {name!r} is a {existing.meta['kind']} state here but a "
                                 f"{kind} state in the restored checkpoint")
            if existing.descriptor is None and meta.get("schema") != existing.meta.get("schema"):
                # a later description (the log after a snapshot): its declared type is the one
                # the values after it were written with
                existing.meta = {k: v for k, v in existing.meta.items() if k != "schema"}
                if meta.get("schema") is not None:
                    existing.meta["schema"] = meta["schema"]
            return existing.state_id
        limit = self.options.max_value_decoded_bytes
        vc, kc = meta.get("value_codec") or "safe", meta.get("key_codec")
        codec = codec_by_name(vc, allow_pickle=allow_pickle, max_decoded_bytes=limit)
        # a map's keys have a codec (the safe one unless the descriptor named another)
        key_codec = codec_by_name(kc or "safe", allow_pickle=allow_pickle,
                                  max_decoded_bytes=limit) if kind == "map" else None
        sid = preferred_id if preferred_id not in self._by_id and 0 <= preferred_id < _MAX_STATES \
            else max(self._by_id, default=-1) + 1
        reg = _Registered(sid, None, StateShape(kind, codec, key_codec), dict(meta))
        self._states[name] = reg
        self._by_id[sid] = reg
        if meta.get("raw") is True:
            if kind != "value" or codec.name != "bytes":
                raise StateError(f"raw state {name!r} must be a value state of bytes, not "
                                 f"{kind}/{codec.name}")
            self._raw.add(sid)
        return sid

    def load_snapshot_entries(self, key_group: int, entries: Iterable[Any],
                              remap: dict[int, int]) -> int:
        """Put snapshot entries ``(state_id, key, namespace, value)`` (bytes) of one key group
        into the table, mapping state ids with ``remap``; returns the count. In bulk
        (:func:`materializer.replay.load_block`): the heap takes each state's run with one
        ``put_all``, LMDB the block's records with one ``putmulti``.

        Raises:
            CorruptObjectError: an entry of a state id the snapshot's metadata does not
                describe (named ``<snapshot entry>``; the loader names the object).
        """
        return load_block(self, key_group, entries, remap)

    def apply_delta_entries(self, key_group: int, entries: Iterable[DeltaEntry],
                            remap: dict[int, int], loader: Any = None) -> int:
        """Restore only: apply a delta's entries ``(state id, key, namespace, value)`` (bytes;
        value ``None``: a tombstone) of one key group to the table, WITHOUT logging them,
        mapping state ids with ``remap``; returns the count. ``loader``: the LMDB table's bulk
        load (:meth:`bulk_restore`), which takes the block's puts as one run of records.

        Raises:
            CorruptObjectError: an entry of a state id the delta's metadata does not describe,
                or a key group this backend does not own (named ``<delta entry>``; the loader
                names the object).
        """
        if key_group not in self.key_groups:
            raise CorruptObjectError("<delta entry>", 0, f"key group {key_group} is not owned "
                                                         f"by backend {self.operator_id!r}")
        t = self._tables
        n = 0
        if loader is not None and not self._heap:
            # the stored bytes as they are: one run of records, tombstones one by one (a
            # delta holds each entry once, so their order does not matter)
            records: list[tuple[bytes, bytes]] = []
            prefixes: dict[int, bytes] = {}
            for sid0, k, ns, v in entries:
                sid = remap.get(sid0, -1)
                if sid not in self._by_id:
                    raise CorruptObjectError("<delta entry>", 0, f"state id {sid0} is not "
                                                                 "described by the delta's "
                                                                 "metadata")
                if v is None:
                    t.remove(sid, key_group, k, ns)
                else:
                    prefix = prefixes.get(sid)
                    if prefix is None:
                        prefix = prefixes[sid] = loader.prefix(key_group, sid)
                    records.append((prefix + _U32_PACK(len(k)) + k + ns, v))
                n += 1
            loader.put_raw(records)
            return n
        for sid0, k, ns, v in entries:
            sid = remap.get(sid0, -1)
            reg = self._by_id.get(sid)
            if reg is None:
                raise CorruptObjectError("<delta entry>", 0, f"state id {sid0} is not described "
                                                             "by the delta's metadata")
            if self._heap and sid not in self._raw:
                tk: Any = self._key_codec.decode(k)
                tn: Any = self._ns_codec.decode(ns)
            else:
                tk, tn = k, ns
            if v is None:
                t.remove(sid, key_group, tk, tn)
            else:
                t.put(sid, key_group, tk, tn,
                      reg.shape.from_bytes(v) if self._heap and sid not in self._raw else v)
            n += 1
        return n

    def install_restored(self, materialized: Iterable[SnapshotRef],
                         non_materialized: Iterable[ChangelogHandle],
                         materialization_id: int) -> None:
        """Make the restored parts the base of the next checkpoints (until the first
        materialization): they keep being referenced, as in Flink — restricted to the key
        groups this backend owns (a part that names none of them is dropped), so its handles
        never claim another backend's share of an older log or snapshot."""
        self._chain_id = -1  # restored pieces: the next materialization is a full one
        snapshots = (r.restricted(self.key_groups) for r in materialized)
        logs = (h.restricted(self.key_groups) for h in non_materialized)
        self._mat.restored(MaterializedBase(tuple(r for r in snapshots if r is not None), 0,
                                            tuple(h for h in logs if h is not None),
                                            materialization_id))

    def table_marker(self, handle: ChangelogStateBackendHandle) -> TableMarker:
        """The marker of this backend's table at checkpoint ``handle`` (this backend's)."""
        return TableMarker(self.operator_id, self.key_groups, self.max_parallelism,
                           handle.checkpoint_id, handle.materialization_id,
                           boundary_of(handle.non_materialized),
                           handle.non_materialized_size, handle.materialized_size,
                           {str(r.state_id): r.meta for r in self._by_id.values()},
                           tuple((p.key, p.materialization_id) for p in handle.materialized),
                           self._table_id)

    def write_table_marker(self, handle: ChangelogStateBackendHandle) -> None:
        """Write the marker of checkpoint ``handle`` into the (LMDB) table. Call it inside the
        write batch that holds the checkpoint's state changes, after the checkpoint's log is
        durable, so the two commit together.

        Raises:
            UsageError: the table is the heap (nothing outside the process can read it).
        """
        if self._heap:
            raise UsageError(f"backend {self.operator_id!r}: a heap table has no marker")
        self._tables.write_marker(self.table_marker(handle).to_bytes())

    def install_materialization(self, ref: SnapshotRef, boundary: tuple[str, int],
                                chain: tuple[SnapshotRef, ...] = ()) -> SnapshotRef | None:
        """Make a snapshot taken elsewhere (the executor agent, from a read transaction of this
        table) the base of the next checkpoints, if this backend's log reaches it.

        The snapshot holds the table as of the change set at ``boundary`` = ``(segment key,
        offset)``. If that change set is in this backend's log (its restored handles or its
        writer's own change sets since the last materialization), the log up to it is replaced by
        the snapshot; otherwise the lineage differs (a re-run batch, a restore elsewhere, a newer
        snapshot already installed) and nothing changes.

        A delta (``ref.delta``) holds only the entries changed since the pieces ``chain`` (a
        full snapshot and the deltas after it): it is installed, with the pieces of ``chain``
        this backend's base lacks, only when the base is a prefix of ``chain`` (same objects,
        same materialization ids: the agent may have written a delta the backend did not install
        before the next one; a base of no snapshot is a prefix of every chain: the agent's full
        snapshot was written after this backend last asked for one), or when ``chain`` starts
        with the base's full snapshot and the delta is newer than the base (a merged delta,
        which replaces the deltas of the base: it holds every entry changed since the full
        snapshot), and the delta's id follows ``chain``'s — else its lineage differs and
        nothing changes. Either way the base's log must reach the delta's boundary.

        Returns:
            The installed reference (a full snapshot's materialization id raised above this
            backend's current one if needed), or ``None`` when it was not installed.
        """
        delta = self.last_delta
        own = delta.change_sets if delta is not None else ()

        def cut(base: MaterializedBase) -> MaterializedBase | None:
            if any(m.key == ref.key for m in base.snapshots):
                return None
            rest = _log_after(base, own, boundary)
            if rest is None:
                return None
            if ref.delta:
                pieces = tuple((p.key, p.materialization_id) for p in base.snapshots)
                named = tuple((p.key, p.materialization_id) for p in chain)
                if (not named
                        or (pieces and named[:len(pieces)] != pieces
                            and not (named[0] == pieces[0]
                                     and ref.materialization_id > base.materialization_id))
                        or ref.materialization_id != named[-1][1] + 1
                        or chain[0].delta or not all(p.delta for p in chain[1:])
                        or any(p.key_groups != ref.key_groups for p in (*base.snapshots,
                                                                        *chain))):
                    return None
                return MaterializedBase((*chain, ref), rest[1], rest[0], ref.materialization_id)
            mat_id = max(ref.materialization_id, base.materialization_id + 1)
            return MaterializedBase((SnapshotRef(ref.key, ref.size, ref.key_groups, mat_id),),
                                    rest[1], rest[0], mat_id)

        new = self._mat.install(cut)
        if new is None:
            return None
        self._chain_id = -1  # a snapshot made elsewhere: the next own one is full
        installed = new.snapshots[-1]
        logger.info("backend %s: installed materialization %d (%s %s, %d bytes) at %s@%d",
                    self.operator_id, installed.materialization_id,
                    "delta" if installed.delta else "snapshot", installed.key,
                    installed.size, boundary[0], boundary[1])
        return installed

    def _apply(self, kg: int, reg: _Registered, ch: Change) -> None:
        t, shape, sid = self._tables, reg.shape, reg.state_id
        if sid in self._raw:
            self._apply_raw(kg, sid, ch)
            return
        key: Any = ch.key
        ns: Any = ch.namespace
        if self._heap:
            key = self._key_codec.decode(ch.key)
            ns = self._ns_codec.decode(ch.namespace)
        op = ch.op  # what it does: the op table (materializer.changes.apply_op)
        cur = t.get(sid, kg, key, ns) if op in READS_CURRENT else None
        new = apply_op(op, shape, cur, ch.payload, objects=self._heap)
        if new is None:
            t.remove(sid, kg, key, ns)
        else:
            t.put(sid, kg, key, ns, new)

    def _apply_raw(self, kg: int, sid: int, ch: Change) -> None:
        """Replay one change of a raw state: bytes in, bytes stored, in either table."""
        if ch.op == CLEAR:
            self._tables.remove(sid, kg, ch.key, ch.namespace)
        elif ch.op == SET:
            self._tables.put(sid, kg, ch.key, ch.namespace, ch.payload)
        else:
            raise CorruptObjectError("<changelog>", 0, f"op code {ch.op} on raw state {sid}")

    # ------------------------------------------------------------------ checkpoints

    def snapshot(self, checkpoint_id: int) -> Future[ChangelogStateBackendHandle]:
        """Checkpoint: persist the log since the last materialization; the future gives this
        backend's handle once that log is durable.

        Raises:
            BackendFailedError: materialization failed too often earlier.
            ClosedError: the backend is closed.
        """
        self._check_open()
        if self._attention:
            self._attend()
        # In flight from the moment it reads its base: a materialization ending while persist()
        # waits (back-pressure) must not truncate [from_sqn, ..). _maybe_truncate reads the base
        # and the registrations under the same lock, so it sees this one or a base at least as
        # new as the one read here.
        with self._lock:
            base = self._mat.base
            from_sqn, mat_id = base.up_to, base.materialization_id
            self._pending_from[checkpoint_id] = from_sqn
        try:
            persist = self._writer.persist(from_sqn, checkpoint_id)
        except BaseException:
            with self._lock:
                self._pending_from.pop(checkpoint_id, None)
            raise
        to_sqn = self._writer.next_sqn()
        # the log after this checkpoint describes its states again, so a snapshot taken at this
        # checkpoint's boundary (install_materialization) leaves a self-describing log to replay
        self._meta_logged.clear()
        self._last_checkpoint = _Checkpoint(checkpoint_id, from_sqn, to_sqn, mat_id)
        self._checkpoint_up_to[checkpoint_id] = (to_sqn, mat_id)
        out: Future[ChangelogStateBackendHandle] = Future()
        out.set_running_or_notify_cancel()

        def done(f: Future[ChangelogHandle]) -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            delta = f.result()
            self.last_delta = delta
            non_mat = base.restored_log + ((delta,) if len(delta) else ())
            self._checkpoint_boundary = (to_sqn, boundary_of(non_mat))
            h = ChangelogStateBackendHandle(self.operator_id, self.key_groups, checkpoint_id,
                                            mat_id, base.snapshots, non_mat,
                                            delta.incremental_size, self.max_parallelism)
            self._non_mat_sizes["lastFullSizeOfNonMaterialization"] = float(
                h.non_materialized_size)
            self._non_mat_sizes["lastIncSizeOfNonMaterialization"] = float(
                delta.incremental_size)
            out.set_result(h)

        persist.add_done_callback(done)
        return out

    def _boundary_at(self, up_to: int) -> tuple[str, int] | None:
        """The last change set of the newest durable checkpoint if its log ends exactly at
        ``up_to`` (a snapshot cut there reflects exactly that checkpoint), else ``None``."""
        cb = self._checkpoint_boundary
        return cb[1] if cb is not None and cb[0] == up_to else None

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """The checkpoint completed: hand its log over, unblock the next materialization."""
        cp = self._last_checkpoint
        entry = self._checkpoint_up_to.get(checkpoint_id)
        with self._lock:
            for c in [c for c in self._pending_from if c <= checkpoint_id]:
                del self._pending_from[c]
        if entry is not None:
            self._mat.confirm(entry[1])
        if cp is not None and cp.checkpoint_id == checkpoint_id:
            self._writer.confirm(cp.from_sqn, cp.to_sqn, checkpoint_id)

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        """The checkpoint was aborted: keep uploads for reuse, drop its pins."""
        cp = self._last_checkpoint
        with self._lock:
            self._pending_from.pop(checkpoint_id, None)
        if cp is not None and cp.checkpoint_id == checkpoint_id:
            self._writer.reset(cp.from_sqn, cp.to_sqn, checkpoint_id)

    def checkpoint_ids(self) -> list[int]:
        """Checkpoints taken by this backend that are not yet subsumed."""
        return sorted(self._checkpoint_up_to)

    def notify_checkpoint_subsumed(self, checkpoint_id: int) -> None:
        """The checkpoint is no longer retained: its log may be truncated once materialized."""
        entry = self._checkpoint_up_to.get(checkpoint_id)
        if entry is None:
            return
        for cp in [c for c in self._checkpoint_up_to if c <= checkpoint_id]:
            del self._checkpoint_up_to[cp]
        self._subsumed_up_to = max(self._subsumed_up_to or 0, entry[0])
        self._maybe_truncate()

    def _maybe_truncate(self) -> None:
        with self._lock:
            base = self._mat.base  # under the lock: see snapshot()
            if self._subsumed_up_to is None or base.materialization_id == 0:
                return
            # Flink's rule, bounded also by checkpoints still in flight: their range must stay
            # until they complete or abort.
            to = min(base.up_to, self._subsumed_up_to,
                     min(self._pending_from.values(), default=base.up_to))
        if to > self._writer.lowest_sqn():
            self._writer.truncate(to)

    # ------------------------------------------------------------------ materialization

    def _wake(self) -> None:
        self._attention = True

    def _attend(self) -> None:
        self._attention = False
        self._mat.attend()

    @property
    def materialization(self) -> MaterializationManager:
        """This backend's materialization manager (state, triggers, guards)."""
        return self._mat

    def materialize_now(self, timeout_s: float | None = None) -> SnapshotRef | None:
        """Run one materialization to completion (the timer's ``run_once``).

        Returns:
            The new snapshot, or ``None`` when skipped (nothing new since the last one, or the
            previous one is not yet confirmed by a completed checkpoint).

        Raises:
            BackendFailedError: this failure was one too many.
            StorageError: the snapshot could not be uploaded (counted as a failure).
        """
        self._check_open()
        return self._mat.run_now(timeout_s)

    def _encode_entry(self, sid: int, key: Any, ns: Any, state: Any) -> tuple[bytes, bytes, bytes]:
        if sid in self._raw:
            return key, ns, state
        return (self._key_codec.encode(key), self._ns_codec.encode(ns),
                self._by_id[sid].shape.to_bytes(state))

    def decode_entry(self, sid: int, key: bytes, ns: bytes, value: bytes
                     ) -> tuple[Any, Any, Any]:
        """Inverse of the snapshot encoder (a heap restore's, and a reader's of an LMDB
        table's stored entries)."""
        if sid in self._raw:
            return key, ns, value
        try:
            return (self._key_codec.decode(key), self._ns_codec.decode(ns),
                    self._by_id[sid].shape.from_bytes(value))
        except CorruptObjectError as exc:
            if self._heap:
                raise   # a restore's input: it names the object
            raise self._stored_value_error(exc, sid, f"stored key {key[:40]!r}") from exc

    # ------------------------------------------------------------------ lifecycle

    @contextlib.contextmanager
    def write_batch(self) -> Iterator[None]:
        """Group many state writes into one table transaction (LMDB: one write transaction
        instead of one per write, ~3x faster; heap: no-op). Use as a context manager.

        An LMDB materialization never starts inside a batch: its read transaction could not see
        the batch's uncommitted writes although the log already holds them. It is deferred to
        the first state access after the batch.
        """
        self._mat.batch_opened()
        try:
            with self._tables.write_batch():
                yield
        finally:
            self._mat.batch_closed()

    def metrics(self) -> dict[str, float]:
        """Materialization counters, last duration, and sizes (Flink's names)."""
        return self._metrics.snapshot()

    @property
    def writer(self) -> ChangelogWriter:
        return self._writer

    @property
    def tables(self) -> Any:
        return self._tables

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"backend {self.operator_id!r}")

    def close(self) -> None:
        """Stop the timer, wait for a running materialization, release the log after the last
        checkpoint, close the table. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._mat.close()
        cp = self._last_checkpoint
        self._writer.truncate_and_close(cp.to_sqn if cp is not None else 0)
        self._tables.close()
        if self._own_dir is not None:
            self._own_dir.remove()
        logger.info("backend %s closed", self.operator_id)


def _log_after(base: MaterializedBase, own: tuple[ChangeSetRef, ...],
               boundary: tuple[str, int]) -> tuple[tuple[ChangelogHandle, ...], int] | None:
    """What is left of a backend's log after the change set at ``boundary`` = ``(segment key,
    offset)``: the restored handles after it and the sqn its own log is then materialized to —
    or ``None`` when neither the restored handles nor its own change sets since ``base``
    (``own``) contain that change set."""
    key, offset = boundary
    restored = base.restored_log
    # from the end: a restored change set may appear in several handles (one per contiguous
    # range of key groups it applies to); the table reflects all of them up to the last one
    for i in range(len(restored) - 1, -1, -1):
        h = restored[i]
        j = next((j for j, r in enumerate(h.change_sets) if r.key == key and r.offset == offset),
                 None)
        if j is not None:
            rest = h.change_sets[j + 1:]
            head = (ChangelogHandle(h.log_id, h.key_groups, rest[0].sqn, h.to_sqn, rest, 0,
                                    h.restrict),) if rest else ()
            return head + restored[i + 1:], base.up_to
    mine = next((r for r in own
                 if r.key == key and r.offset == offset and r.sqn >= base.up_to), None)
    return None if mine is None else ((), mine.sqn + 1)


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
