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
  ``up_to = writer.next_sqn()``; the table snapshot is taken on the owner thread and written
  out and uploaded on the ``dstl-materializer`` thread while the owner keeps writing. When it is
  due is :mod:`materializer.policy`'s rule; the timer, the guards, the write-batch deferral and
  the failure count (``max_failures`` consecutive failures fail the backend: the next call raises
  :class:`~dstl.errors.BackendFailedError` chained to the cause) are
  :class:`~materializer.manager.MaterializationManager`'s, which also holds the materialized
  base the checkpoints reference. With ``auto_materialize=False`` the backend never starts one
  by itself: its owner asks ``materialization.due()`` (the Spark task).
- **Timer thread vs owner thread.** The heap table has a single writer, so the triggers only raise
  a flag; the owner thread runs the (short) synchronous part at its next state access or
  checkpoint.
- **Truncation.** ``writer.truncate(min(materialized_up_to, subsumed_checkpoint_up_to))``: a change
  set is dropped only when it is materialized and every checkpoint that named it is subsumed.
- **Materialized elsewhere.** An LMDB table can be materialized by another process (the executor
  agent) from a read transaction; :meth:`write_table_marker` and :meth:`install_materialization`
  are the two ends (:mod:`materializer.base_installs`).

The backend is a facade over one object per job, each in its own module, talking through small
Protocols: the states (:mod:`materializer.state_registry`), the write path under the current key
(:mod:`materializer.state_access`; the state objects hold it directly), the conversion to a
declared type (:mod:`materializer.declared_types`), the snapshot writers
(:mod:`materializer.snapshot_writers`), the checkpoints (:mod:`materializer.checkpoint_book`),
the restore's filling of the table (:mod:`materializer.restore_target`) and the installed bases
(:mod:`materializer.base_installs`). The facade owns the table's lifecycle (open, replace, close)
and the TTL service.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

from dstl.errors import CorruptObjectError, UsageError
from dstl.handle import ChangelogHandle
from dstl.keygroups import KeyGroupRange
from dstl.layout import operator_dir
from dstl.metrics import MetricsRegistry
from dstl.options import DstlOptions
from dstl.retry import RetryPolicy
from dstl.timer import Timer
from dstl.writer import ChangelogWriter
from materializer.backend_checks import check_arguments, check_layout, check_local, check_storage
from materializer.base_installs import BaseInstaller
from materializer.checkpoint_book import CheckpointBook
from materializer.codecs import Codec, StrOrBytesKeyCodec
from materializer.declared_types import adopt_declared_type
from materializer.delta_format import DeltaEntry
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef
from materializer.local_dirs import OwnDirectory, prepare_environment
from materializer.manager import MaterializationManager
from materializer.options import BackendOptions
from materializer.policy import MaterializationRules
from materializer.restore_target import RestoreTarget
from materializer.snapshot_writers import SnapshotWriters, new_snapshot_key, upload_snapshot
from materializer.state_access import NamespaceCodec, StateTableAccess
from materializer.state_registry import Registration, StateRegistry
from materializer.states import STATE_CLASSES, KeyedState, StateDescriptor, StateShape
from materializer.table_marker import TableMarker
from materializer.ttl import TTL_INDEX_STATE, TtlService, new_ttl_state

__all__ = ["ChangelogKeyedStateBackend", "check_layout", "check_storage", "new_snapshot_key",
           "upload_snapshot"]

logger = logging.getLogger(__name__)


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
        self.options = check_arguments(storage, operator_id, key_groups, max_parallelism,
                                       table, options, key_codec, local_directory, timer,
                                       clear_local, adopt_local, auto_materialize)
        check_local(operator_id, table, local_directory, clear_local, adopt_local)
        self.operator_id = operator_id
        self.key_groups = key_groups
        self.max_parallelism = max_parallelism
        self.table_kind = table
        self._heap = table == "heap"
        rules = MaterializationRules.of(self.options)  # may refuse the options: before opening
        self._own_dir: OwnDirectory | None = None
        self._closed = False
        opened: Any = None
        # the writer first: it refuses an operator id that is live in this storage before any
        # local table of that operator is touched
        self._writer: ChangelogWriter = storage.create_writer(operator_id, key_groups)
        try:
            opened = self._open_tables(local_directory, clear_local, adopt_local)
            # the table's incarnation (materializer.table_marker): kept when adopting the table,
            # new when the table is created or restored
            table_id = (self._adopted_table_id(opened) if adopt_local else "") or \
                secrets.token_hex(8)
            self._init_jobs(storage, opened, key_codec, table_id, rules, timer, auto_materialize)
        except BaseException:
            self._abandon(opened)
            raise
        logger.info("backend %s opened: %s table, key groups %s", operator_id, table, key_groups)

    def _init_jobs(self, storage: Any, tables: Any, key_codec: Codec | None, table_id: str,
                   rules: MaterializationRules, timer: Timer | None,
                   auto_materialize: bool) -> None:
        """Build the jobs (see the module docstring) and connect them."""
        o = self.options
        self._metrics = MetricsRegistry(f"ChangelogBackend.{self.operator_id}.")
        self._registry = StateRegistry(self.operator_id, o.max_value_decoded_bytes)
        self._access = StateTableAccess(
            self.operator_id, self.key_groups, self.max_parallelism, self.table_kind, tables,
            self._writer, self._registry, key_codec or StrOrBytesKeyCodec(),
            NamespaceCodec(o.max_value_decoded_bytes), track_changes=o.incremental_snapshots,
            max_changes=o.max_delta_entries, origin=self._origin)
        self._book = CheckpointBook(self.operator_id, self.key_groups, self.max_parallelism,
                                    self._writer, self._registry, self._metrics)
        # snapshot uploads retry like segment uploads (the storage's options)
        retry = RetryPolicy.for_uploads(getattr(storage, "options", None) or DstlOptions())
        self._snapshots = SnapshotWriters(self._access, self._registry, self._writer, o,
                                          storage.store, retry, self.max_parallelism,
                                          self._book.boundary_at, self._book.maybe_truncate)
        self._installer = BaseInstaller(self.operator_id, self.key_groups, self.max_parallelism,
                                        self._registry, table_id, lambda: self._book.last_delta,
                                        self._snapshots.forget_chain)
        self._restore = RestoreTarget(self._access, self._registry)
        self._ttl: TtlService | None = None  # with the first TTL state (materializer.ttl)
        self._ttl_time: int | None = None
        self._mat = MaterializationManager(
            self.operator_id, rules, self._snapshots, self._metrics, wake=self._access.wake,
            timer=timer, automatic=auto_materialize, defer_in_batch=not self._heap)
        base = lambda: self._mat.base  # noqa: E731 - the manager's current base, read late
        self._access.attach(self._mat)
        self._snapshots.attach(base)
        self._book.attach(base, self._mat.confirm)
        self._installer.attach(self._mat)

    # ------------------------------------------------------------------ the table's lifecycle

    def _origin(self) -> str:
        """Where the table's values came from (the base's objects), for a value that does not
        decode."""
        base = self._mat.base
        origin = [s.key for s in base.snapshots]
        origin += list(dict.fromkeys(r.key for h in base.restored_log for r in h.change_sets))
        return (f"; its state came from {', '.join(origin[:4])}"
                f"{f' and {len(origin) - 4} more' if len(origin) > 4 else ''}" if origin else "")

    @staticmethod
    def _adopted_table_id(tables: Any) -> str:
        """The ``table_id`` of the adopted table's marker (``""``: none, or unreadable — the
        caller checks the marker itself before using the table)."""
        raw = tables.read_marker()
        if raw is None:
            return ""
        try:
            return TableMarker.from_bytes(raw).table_id
        except CorruptObjectError:
            return ""

    def _abandon(self, tables: Any) -> None:
        """A constructor failed midway: release what it opened (log id, table, own directory)."""
        self._writer.close()
        if tables is not None:
            tables.close()
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
        path = self._access.tables.path
        self._access.tables.close()
        # named like a restore's staging directories, so a restore killed between the two
        # renames leaves debris the next restore removes (restore.file_restore)
        old = os.path.join(os.path.dirname(path),
                           f".dstl-stage-{os.getpid()}-old-{secrets.token_hex(4)}")
        with contextlib.suppress(FileNotFoundError):
            os.rename(path, old)
        os.rename(directory, path)
        shutil.rmtree(old, ignore_errors=True)
        from materializer.lmdb_table import LmdbStateTable
        self._access.tables = LmdbStateTable(
            path, self.key_groups, map_size_bytes=self.options.lmdb_map_size_bytes,
            max_map_size_bytes=self.options.lmdb_max_map_size_bytes)

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
            with self._access.tables.write_batch():
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
        return self._access.tables

    def _check_open(self) -> None:
        self._access.check_open()

    def close(self) -> None:
        """Stop the timer, wait for a running materialization, release the log after the last
        checkpoint, close the table. Idempotent."""
        if self._closed:
            return
        self._closed = self._access.closed = True
        self._mat.close()
        self._book.close_log()
        self._access.tables.close()
        if self._own_dir is not None:
            self._own_dir.remove()
        logger.info("backend %s closed", self.operator_id)

    # ------------------------------------------------------------------ key / namespace

    def set_current_key(self, key: Any) -> None:
        """Set the key that state calls refer to.

        Raises:
            KeyGroupError: the key's key group is not owned by this backend.
            UsageError: the key codec cannot encode the key.
        """
        self._access.set_current_key(key)

    def get_current_key(self) -> Any:
        return self._access.get_current_key()

    @property
    def current_key_bytes(self) -> bytes:
        """The current key as the key codec encodes it (``UsageError``: no current key)."""
        return self._access.current_key_bytes

    @property
    def current_key_group(self) -> int:
        """The key group of the current key (``UsageError``: no current key)."""
        return self._access.current_key_group

    def set_current_namespace(self, namespace: Any) -> None:
        """Set the namespace (e.g. a window); ``None`` is the default namespace."""
        self._access.set_current_namespace(namespace)

    @property
    def current_namespace(self) -> Any:
        return self._access.current_namespace

    @property
    def current_namespace_bytes(self) -> bytes:
        return self._access.current_namespace_bytes

    @property
    def has_current_key(self) -> bool:
        return self._access.has_current_key

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
        if self._ttl is None and TTL_INDEX_STATE in self._registry.by_name:
            self._ttl = TtlService(self._access)
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
            StateSchemaError: a restored state's stored values do not fit its declared type
                (:mod:`materializer.declared_types`).
        """
        self._check_open()
        reg = self._registry.register(descriptor, self._adopt_declared_type)
        if reg.state is None:
            reg.state = self._new_state(reg.state_id, descriptor, reg.shape)
        return reg.state

    def _adopt_declared_type(self, reg: Registration, shape: StateShape, declared: Any,
                             meta: dict[str, Any]) -> None:
        adopt_declared_type(self._access, self._registry.logged, reg, shape, declared, meta)

    def _new_state(self, sid: int, descriptor: StateDescriptor, shape: StateShape) -> KeyedState:
        """The state object of ``descriptor`` (a TTL state with ``ttl_s``), on the write path."""
        if descriptor.ttl_s is None:
            return STATE_CLASSES[descriptor.kind](self._access, sid, descriptor, shape)
        if self._ttl is None:
            self._ttl = TtlService(self._access)
            self._ttl.set_time(self._ttl_time)
        return new_ttl_state(self._access, sid, descriptor, shape, self._ttl, descriptor.ttl_s)

    def state_names(self) -> list[str]:
        return self._registry.names()

    def internal_state_ids(self) -> list[int]:
        """Ids of the states that are DSTL's own, not the user's: the raw indexes and the
        states whose name starts with ``$`` (the timer service's)."""
        return self._registry.internal_ids()

    def delete_state_entries(self, name: str) -> int:
        """Remove every entry of state ``name`` — all keys and namespaces of this backend —
        and return how many (no such state: 0). Each removal is logged as a ``CLEAR`` of its
        key and namespace, so a replay removes the same entries. The state stays registered:
        ``get_state`` opens it again, empty (Spark's ``deleteIfExists``).

        Raises:
            UsageError: ``name`` is an internal index (raw state).
        """
        self._check_open()
        reg = self._registry.by_name.get(name)
        if reg is None:
            return 0
        if reg.state_id in self._registry.raw:
            raise UsageError(f"state {name!r} is an internal index of backend "
                             f"{self.operator_id!r}; it cannot be deleted")
        return self._access.delete_entries(reg)

    def state_metadata(self) -> dict[int, dict[str, Any]]:
        """Every registered state by id: its metadata (``name``, ``kind``, ``value_codec``,
        ``key_codec``), as recorded in snapshots and metadata records (a copy)."""
        return self._registry.metadata()

    # ------------------------------------------------------------------ StateAccess (the states)
    # materializer.states.StateAccess, on the write path (materializer.state_access, where each
    # is described); the backend's own state objects hold the write path itself.

    def before_read(self) -> None:
        self._access.before_read()

    def read_state(self, sid: int, shape: StateShape) -> Any:
        return self._access.read_state(sid, shape)

    def read_state_raw(self, sid: int) -> Any:
        return self._access.read_state_raw(sid)

    def before_mutation(self) -> None:
        self._access.before_mutation()

    def write_state(self, sid: int, value: Any) -> None:
        self._access.write_state(sid, value)

    def write_state_object(self, sid: int, shape: StateShape, obj: Any) -> None:
        self._access.write_state_object(sid, shape, obj)

    def remove_state(self, sid: int) -> None:
        self._access.remove_state(sid)

    def log_change(self, op: int, sid: int, payload: bytes) -> None:
        self._access.log_change(op, sid, payload)

    def merge_state_namespaces(self, sid: int, shape: StateShape, target: Any,
                               sources: Iterable[Any], fn: Callable[[Any, Any], Any]) -> None:
        self._access.merge_state_namespaces(sid, shape, target, sources, fn)

    # ------------------------------------------------------------------ raw states
    # Internal indexes (the timer service's time index, materializer/timers.py): entries at an
    # explicit key group with raw key, namespace and value bytes (materializer.state_access).

    def register_raw_state(self, name: str) -> int:
        """Register (or look up) the raw state ``name``; returns its state id.

        Raises:
            UsageError: a state of that name exists and is not raw, or too many states.
        """
        return self._access.register_raw_state(name)

    def raw_put(self, sid: int, key_group: int, key: bytes, namespace: bytes,
                value: bytes) -> None:
        """Store and log a raw entry."""
        self._access.raw_put(sid, key_group, key, namespace, value)

    def raw_remove(self, sid: int, key_group: int, key: bytes, namespace: bytes) -> bool:
        """Remove a raw entry (logged when it existed); whether it existed."""
        return self._access.raw_remove(sid, key_group, key, namespace)

    def raw_get(self, sid: int, key_group: int, key: bytes, namespace: bytes) -> bytes | None:
        """A raw entry's value, or ``None``."""
        return self._access.raw_get(sid, key_group, key, namespace)

    def raw_entries(self, sid: int, key_group: int) -> Iterator[tuple[bytes, bytes, bytes]]:
        """``(key, namespace, value)`` of a raw state in one key group (LMDB: sorted by key
        bytes; heap: in no particular order)."""
        return self._access.raw_entries(sid, key_group)

    # ------------------------------------------------------------------ restore hooks
    # materializer.replay.ReplayTarget; the work is materializer.restore_target's.

    def apply_change(self, key_group: int, payload: bytes, *, remap: dict[int, int] | None = None,
                     allow_pickle: bool = False) -> None:
        """Apply one logged change to the table WITHOUT logging it again (used by restore).

        A metadata record (key group -1) registers its state and, when ``remap`` is given, maps
        the log's state id to this backend's id for that name. A change of a key group this
        backend does not own is corruption, never skipped.

        Raises:
            CorruptObjectError: malformed record, a change before its state's metadata, or a
                change of a key group outside this backend's range.
            StateError: the log names a state with a different kind than this backend knows.
        """
        self._restore.apply_change(key_group, payload, remap=remap, allow_pickle=allow_pickle)

    def is_raw_state(self, state_id: int) -> bool:
        """Whether ``state_id`` is a raw state (bytes in, bytes stored; no codec)."""
        return state_id in self._registry.raw

    def registered_state(self, state_id: int) -> Registration | None:
        """The registration of this backend's ``state_id`` (its shape and metadata), if any."""
        return self._registry.get(state_id)

    @property
    def key_codec(self) -> Codec:
        """How this backend encodes keys."""
        return self._access.key_codec

    @property
    def namespace_codec(self) -> NamespaceCodec:
        """How this backend encodes namespaces (``None`` is ``b""``)."""
        return self._access.namespace_codec

    def bulk_restore(self) -> contextlib.AbstractContextManager[Any]:
        """The write batch of a restore's bulk replay: LMDB's
        :class:`~materializer.lmdb_table.LmdbBulkLoad` (commits as it goes), ``None`` for the
        heap (writes are immediate). See :mod:`materializer.replay`."""
        return self._restore.bulk_restore()

    def register_restored_state(self, meta: dict[str, Any], preferred_id: int, *,
                                allow_pickle: bool = False) -> int:
        """Register a state known from a snapshot or the log; return its id in this backend
        (``preferred_id`` when free; a state of the same name keeps its id).

        Raises:
            StateError: same name, different kind; or an unknown kind.
            UsageError: its codec is not built in (or is pickle without ``allow_pickle``).
        """
        return self._registry.register_restored(meta, preferred_id, allow_pickle=allow_pickle)

    def load_snapshot_entries(self, key_group: int, entries: Iterable[Any],
                              remap: dict[int, int]) -> int:
        """Put snapshot entries ``(state_id, key, namespace, value)`` (bytes) of one key group
        into the table, mapping state ids with ``remap``; returns the count. In bulk
        (:func:`materializer.replay.load_block`).

        Raises:
            CorruptObjectError: an entry of a state id the snapshot's metadata does not
                describe (named ``<snapshot entry>``; the loader names the object).
        """
        return self._restore.load_snapshot_entries(key_group, entries, remap)

    def apply_delta_entries(self, key_group: int, entries: Iterable[DeltaEntry],
                            remap: dict[int, int], loader: Any = None) -> int:
        """Restore only: apply a delta's entries (value ``None``: a tombstone) of one key group
        to the table, WITHOUT logging them, mapping state ids with ``remap``; returns the count.
        ``loader``: the LMDB table's bulk load (:meth:`bulk_restore`).

        Raises:
            CorruptObjectError: an entry of a state id the delta's metadata does not describe,
                or a key group this backend does not own.
        """
        return self._restore.apply_delta_entries(key_group, entries, remap, loader)

    def decode_entry(self, sid: int, key: bytes, ns: bytes, value: bytes
                     ) -> tuple[Any, Any, Any]:
        """Inverse of the snapshot encoder (a heap restore's, and a reader's of an LMDB
        table's stored entries)."""
        return self._restore.decode_entry(sid, key, ns, value)

    def encode_entry(self, sid: int, key: Any, ns: Any, state: Any
                     ) -> tuple[bytes, bytes, bytes]:
        """A heap table's entry as a snapshot holds it (bytes): :meth:`decode_entry`'s
        inverse."""
        return self._snapshots.encode_entry(sid, key, ns, state)

    # ------------------------------------------------------------------ installed bases

    def install_restored(self, materialized: Iterable[SnapshotRef],
                         non_materialized: Iterable[ChangelogHandle],
                         materialization_id: int) -> None:
        """Make the restored parts the base of the next checkpoints (until the first
        materialization): they keep being referenced, as in Flink — restricted to the key
        groups this backend owns (a part that names none of them is dropped), so its handles
        never claim another backend's share of an older log or snapshot."""
        self._installer.install_restored(materialized, non_materialized, materialization_id)

    def table_marker(self, handle: ChangelogStateBackendHandle) -> TableMarker:
        """The marker of this backend's table at checkpoint ``handle`` (this backend's)."""
        return self._installer.table_marker(handle)

    def write_table_marker(self, handle: ChangelogStateBackendHandle) -> None:
        """Write the marker of checkpoint ``handle`` into the (LMDB) table. Call it inside the
        write batch that holds the checkpoint's state changes, after the checkpoint's log is
        durable, so the two commit together.

        Raises:
            UsageError: the table is the heap (nothing outside the process can read it).
        """
        self._installer.write_table_marker(None if self._heap else self._access.tables, handle)

    def install_materialization(self, ref: SnapshotRef, boundary: tuple[str, int],
                                chain: tuple[SnapshotRef, ...] = ()) -> SnapshotRef | None:
        """Make a snapshot taken elsewhere (the executor agent, from a read transaction of this
        table) the base of the next checkpoints, if this backend's log reaches the change set at
        ``boundary``; a delta only with the pieces ``chain`` it follows (the rules:
        :meth:`materializer.base_installs.BaseInstaller.install_materialization`).

        Returns:
            The installed reference, or ``None`` when it was not installed.
        """
        return self._installer.install_materialization(ref, boundary, chain)

    # ------------------------------------------------------------------ checkpoints

    def snapshot(self, checkpoint_id: int) -> Future[ChangelogStateBackendHandle]:
        """Checkpoint: persist the log since the last materialization; the future gives this
        backend's handle once that log is durable (:mod:`materializer.checkpoint_book`).

        Raises:
            BackendFailedError: materialization failed too often earlier.
            ClosedError: the backend is closed.
        """
        self._check_open()
        self._access.before_mutation()  # pending materialization work first
        return self._book.snapshot(checkpoint_id)

    @property
    def last_delta(self) -> ChangelogHandle | None:
        """The log part of the newest checkpoint that this backend's writer produced."""
        return self._book.last_delta

    @property
    def checkpoints(self) -> CheckpointBook:
        """This backend's checkpoints (in flight, retained, and the truncation they allow)."""
        return self._book

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """The checkpoint completed: hand its log over, unblock the next materialization."""
        self._book.complete(checkpoint_id)

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        """The checkpoint was aborted: keep uploads for reuse, drop its pins."""
        self._book.abort(checkpoint_id)

    def checkpoint_ids(self) -> list[int]:
        """Checkpoints taken by this backend that are not yet subsumed."""
        return self._book.ids()

    def notify_checkpoint_subsumed(self, checkpoint_id: int) -> None:
        """The checkpoint is no longer retained: its log may be truncated once materialized."""
        self._book.subsume(checkpoint_id)

    # ------------------------------------------------------------------ materialization

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
