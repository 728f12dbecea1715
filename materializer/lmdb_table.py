"""On-disk state table: one LMDB environment per owner directory, all states, bytes only.

Theory of operation
-------------------
Key layout (one LMDB database, keys compared bytewise)::

    offset  size  field
    0       2     key group, u16 big-endian
    2       2     state id, u16 big-endian
    4       4     key length L, u32 big-endian
    8       L     key bytes
    8+L     rest  namespace bytes

So all entries of a key group are one contiguous key range, a key-group *range* is one contiguous
scan, and inside a key group the states come in ascending state id (which is the order the snapshot
format stores them in). The length prefix keeps ``(key, namespace)`` pairs unambiguous. Reserved
records at key group ``0xFFFF`` (outside any real range) store the layout version, the table
marker and, in layout ``"2"``, the table's zstd dictionaries.

Layouts: a new table is of layout ``"2"``: every value is stored through the table's
:class:`~materializer.value_codec.ValueCodec` (a tag byte, then the bytes as they are or a zstd
frame made with the table's dictionary), and every read decodes. The first write batch that
holds enough values trains the dictionary (:mod:`materializer.value_codec`, rule 1) and rewrites
the values it wrote before that in the same transaction; an aborted batch leaves no dictionary.
A table of layout ``"1"`` (values as the caller's bytes) stays of layout ``"1"``: it is read
and written as it is (a restore installs a layout-1 snapshot file by rename; a range copy
writes layout ``"2"``, :mod:`materializer.lmdb_files`). LMDB limits a key to ``env.max_key_size()`` (511) bytes, so ``key + namespace`` may
take at most 503 bytes; longer ones are a :class:`~dstl.errors.UsageError`.

Writes: every write outside a batch is its own write transaction (~40k/s); ``write_batch()`` groups
writes of the calling thread into one transaction (~10x faster). A batch keeps a journal of its
operations, so when LMDB reports a full map the transaction is aborted, the map grown (doubled, up
to ``max_map_size_bytes``) and the journal replayed: a batch is atomic and never half-applied.
The journal holds :data:`JOURNAL_MEMORY_BYTES` in memory and the rest in an unnamed temporary
file beside the table, so a batch writing much of the table does not hold it twice in memory.
Beyond the maximum a :class:`~dstl.errors.StateTableFullError` names the setting.

Memory: without ``writemap`` a write transaction keeps every page it changes in memory until it
ends (a random update changes a whole page), and LMDB then keeps those page buffers for reuse
until the environment closes — a table once written by a large batch would hold that batch's
pages for its lifetime (measured: 49 MB kept after one transaction of 100 k puts of 300 bytes).
So a batch counts its changes: after one that may have changed more than
:data:`RELEASE_PAGES_BYTES` of pages the environment is reopened, which frees them, and the
freed heap is returned to the system (:mod:`materializer.heap`; skipped while
a snapshot or an ``entries()`` scan of this process is open), and a bulk load commits once its
transaction may hold that many. ``writemap`` would avoid the buffers, but it writes through the
map into a sparse file, where a full disk is a ``SIGBUS`` instead of an error.

Snapshots: ``snapshot()`` opens a read transaction (MVCC), so writers continue while it is written
out on another thread. py-lmdb invalidates every open transaction when the map is resized, so
growth waits until open snapshots are released (at most ``grow_wait_s``), and ``snapshot()`` first
grows the map to twice the used size when it can, so writers rarely need to grow during a write-out.
All reads hold a small in-process guard that a resize waits for.

Concurrency: the environment is shared by threads; one write transaction at a time (a Python lock
serialises writers; a batch holds it until it ends). Reads from any thread; a batch's own thread
reads through the batch (it sees its uncommitted writes). Other processes may open the same
directory (LMDB is multi-process); a map grown by another process is adopted.

Fork rule: an LMDB environment must never be used in a forked child. The table records its pid at
open; any use from another pid raises :class:`ForkedTableError`, and an ``os.register_at_fork``
hook makes a child keep (never close, never touch) the parent's environments and transactions.
The current pid is cached in the module (``_CURRENT_PID``) and refreshed by that same hook: the
check runs on every operation, and ``os.getpid()`` is a system call (0.4-0.7 µs, the largest
single cost of a restore's ``put`` once measured), while a fork is what changes it.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import lmdb

from dstl.checks import (
    check_bool,
    check_instance,
    check_int,
    check_number,
    check_optional_path,
)
from dstl.errors import (
    ClosedError,
    ConfigError,
    ConfigTypeError,
    CorruptValueError,
    DstlError,
    KeyGroupError,
    LocalDiskFullError,
    StateError,
    StateTableFullError,
    UnsupportedFormatError,
    UsageError,
)
from dstl.keygroups import KeyGroupRange
from materializer.heap import release_free_memory
from materializer.options import MAX_LMDB_MAP_SIZE_BYTES, MIN_LMDB_MAP_SIZE_BYTES
from materializer.snapshot_format import SnapshotEntry
from materializer.state_tables import (
    DecodeFn,
    EncodeFn,
    SnapshotReader,
    TablesSnapshot,
    check_state_id,
)
from materializer.value_codec import (
    DICT_KEY_PREFIX,
    MAX_SAMPLE_BYTES,
    MIN_COMPRESSED_VALUE_BYTES,
    TRAIN_MAX_SAMPLES,
    TRAIN_MIN_VALUES,
    ValueCodec,
    dictionary_key,
    dictionary_number,
    train_dictionary,
)

__all__ = [
    "RELEASE_PAGES_BYTES",
    "JOURNAL_MEMORY_BYTES",
    "DEFAULT_GROW_WAIT_S",
    "DEFAULT_MAP_SIZE_BYTES",
    "DEFAULT_MAX_MAP_SIZE_BYTES",
    "KEY_PREFIX",
    "KG_SID",
    "LAYOUT_KEY",
    "LAYOUT_VERSION",
    "LAYOUT_VERSIONS",
    "MARKER_KEY",
    "ForkedTableError",
    "LmdbBulkLoad",
    "LmdbStateTable",
    "LmdbTableSnapshot",
    "LmdbWriteBatch",
]

log = logging.getLogger(__name__)

#: Initial map size. Virtual address space and a sparse file, so generous is cheap.
DEFAULT_MAP_SIZE_BYTES: Final = 64 * 1024 * 1024
#: Growth stops here; a Spark executor's local disk is the real limit.
DEFAULT_MAX_MAP_SIZE_BYTES: Final = 64 * 1024 * 1024 * 1024
#: Longest a writer waits for open snapshots to be released before the map can grow.
DEFAULT_GROW_WAIT_S: Final = 60.0
#: Pages a write transaction may change (changes x page size, an upper bound) before the
#: environment is reopened after it, and before a bulk load commits (module docstring).
RELEASE_PAGES_BYTES: Final = 16 << 20
#: A write batch's journal in memory at most (keys, values and a per-operation allowance);
#: beyond it, in a temporary file (:class:`_Journal`).
JOURNAL_MEMORY_BYTES: Final = 16 << 20

_PREFIX: Final = struct.Struct(">HHI")   # key group, state id, key length
_KG_SID: Final = struct.Struct(">HH")
_LAYOUT_KEY: Final = b"\xff\xff" + b"dstl-layout"
#: The layout a new table writes; :data:`LAYOUT_VERSIONS` are those a table may hold.
_LAYOUT_VERSION: Final = b"2"
_LAYOUT_1: Final = b"1"
#: The table marker (:mod:`materializer.table_marker`): what the table reflects, written in the
#: transaction of the state it describes. Outside every key-group range, like the layout record.
_MARKER_KEY: Final = b"\xff\xff" + b"dstl-marker"
#: The key layout's records, for code that reads environment files without a table
#: (:mod:`materializer.lmdb_files`).
KEY_PREFIX: Final = _PREFIX
KG_SID: Final = _KG_SID
LAYOUT_KEY: Final = _LAYOUT_KEY
LAYOUT_VERSION: Final = _LAYOUT_VERSION
LAYOUT_VERSIONS: Final = (_LAYOUT_1, _LAYOUT_VERSION)
MARKER_KEY: Final = _MARKER_KEY
_RAW_TAG: Final = b"\x00"                # a layout-2 value stored as it is
_SCAN_CHUNK: Final = 4096                # entries per guarded cursor pass of entries()
_PAGE_HEADER: Final = 16                 # LMDB's page header (pgno, pad, flags, lower, upper)
_FILL_SAMPLE: Final = 2048               # records leaf_fill() reads, at most

#: ``(record key, stored value) -> value`` of layout "2" (:meth:`LmdbStateTable._decoder`).
_Decode = Callable[[bytes, bytes], bytes]

# Environments of tables opened before a fork: the child keeps them referenced forever so that
# deallocation never runs LMDB code on the parent's environment or reader slots.
_OPEN_TABLES: weakref.WeakSet[LmdbStateTable] = weakref.WeakSet()
_ABANDONED_IN_CHILD: list[object] = []


class ForkedTableError(UsageError):
    """An :class:`LmdbStateTable` was used in a process forked from the one that opened it."""

    def __init__(self, path: str, opened_pid: int, pid: int) -> None:
        self.path = path
        self.opened_pid = opened_pid
        self.pid = pid
        super().__init__(f"LmdbStateTable {path} was opened in process {opened_pid} and cannot be "
                         f"used in forked process {pid} (LMDB environments do not survive fork; "
                         "open a new LmdbStateTable in the child)")


#: This process's pid, refreshed in a forked child by :func:`_after_fork_in_child` (which
#: ``os.fork`` and ``multiprocessing`` run), so the per-operation fork check is no system call.
_CURRENT_PID = os.getpid()


def _after_fork_in_child() -> None:
    global _CURRENT_PID
    _CURRENT_PID = os.getpid()
    for table in list(_OPEN_TABLES):
        table._abandon_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Journal:
    """A write batch's operations since its transaction began, for replay into a new one after
    the map grew (see ``_grow_and_replay``): the first :data:`JOURNAL_MEMORY_BYTES` of keys and
    values in memory, the rest appended to an unnamed temporary file in ``directory`` (the
    table's parent: the local disk), which only a replay reads back. So a batch that writes a
    large part of the table keeps a bounded journal in memory (measured: 102 MB of journal for
    250 k puts of 256-byte values, before the bound)."""

    __slots__ = ("_directory", "file", "ops", "room")

    def __init__(self, directory: str) -> None:
        self._directory = directory
        self.ops: list[tuple[Any, ...]] = []
        self.room = JOURNAL_MEMORY_BYTES   # bytes left in memory (the writer's hot path: inline)
        self.file: Any = None

    def append(self, op: tuple[Any, ...]) -> None:
        """Journal ``op`` (the inline fast path of ``_write`` does the same while there is
        room in memory)."""
        if self.file is None and self.room > 0:
            self.ops.append(op)
            self.room -= _op_bytes(op)
            return
        if self.file is None:
            try:
                self.file = tempfile.TemporaryFile(  # noqa: SIM115 (closed by clear())
                    dir=self._directory, prefix=".dstl-journal-")
            except OSError as exc:
                raise _journal_error(self._directory, exc) from exc
        try:
            self.file.write(_encode_op(op))
        except OSError as exc:
            raise _journal_error(self._directory, exc) from exc

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        yield from self.ops
        f = self.file
        if f is None:
            return
        try:
            f.flush()
            end = f.tell()
            f.seek(0)
            while f.tell() < end:
                yield _decode_op(f)
            f.seek(end)
        except OSError as exc:
            raise _journal_error(self._directory, exc) from exc

    def clear(self) -> None:
        """Forget every operation (the transaction committed or ended); removes the file."""
        self.ops = []
        self.room = JOURNAL_MEMORY_BYTES
        if self.file is not None:
            f, self.file = self.file, None
            f.close()


_OP_HEAD: Final = struct.Struct(">cII")   # kind, key (or count) length, value length


def _op_bytes(op: tuple[Any, ...]) -> int:
    """What a journaled operation holds in memory: its keys and values, 64 bytes each besides."""
    kind = op[0]
    if kind == "put":
        return 64 + len(op[1]) + len(op[2])
    if kind == "putmulti":
        return sum(64 + len(k) + len(v) for k, v in op[1])
    return 64 + (len(op[1]) if kind == "del" else 0)


def _encode_op(op: tuple[Any, ...]) -> bytes:
    kind = op[0]
    if kind == "put":
        k, v = bytes(op[1]), bytes(op[2])
        return _OP_HEAD.pack(b"P", len(k), len(v)) + k + v
    if kind == "del":
        k = bytes(op[1])
        return _OP_HEAD.pack(b"D", len(k), 0) + k
    if kind == "clear":
        return _OP_HEAD.pack(b"C", op[1], 0)
    records = op[1]
    parts = [_OP_HEAD.pack(b"M", len(records), 0)]
    for k, v in records:
        parts += (_OP_HEAD.pack(b"R", len(k), len(v)), k, bytes(v))
    return b"".join(parts)


def _decode_op(f: Any) -> tuple[Any, ...]:
    """One operation :func:`_encode_op` wrote (this process's own file: not untrusted)."""
    kind, a, b = _OP_HEAD.unpack(f.read(_OP_HEAD.size))
    if kind == b"P":
        return ("put", f.read(a), f.read(b))
    if kind == b"D":
        return ("del", f.read(a))
    if kind == b"C":
        return ("clear", a)
    records = []
    for _ in range(a):
        _, kl, vl = _OP_HEAD.unpack(f.read(_OP_HEAD.size))
        records.append((f.read(kl), f.read(vl)))
    return ("putmulti", records)


def _journal_error(directory: str, exc: OSError) -> DstlError:
    if exc.errno == errno.ENOSPC:
        return LocalDiskFullError(f"writing an LMDB write batch's journal in {directory}: "
                                  f"{exc} (free local disk space)", path=directory)
    return StateError(f"writing an LMDB write batch's journal in {directory} failed: {exc}")


class LmdbWriteBatch:
    """Groups the calling thread's writes into one LMDB transaction (see ``write_batch``).

    Writes go through the table's normal methods (``put``/``remove``/``clear_state``) or through
    the batch's own ``put``/``remove``. Commits on a clean exit, aborts if the block raises.
    """

    def __init__(self, table: LmdbStateTable) -> None:
        self._table = table
        self._outer = False
        self.txn: Any = None
        self.journal = _Journal(os.path.dirname(os.path.abspath(table.path)))
        self.thread = 0
        self.changes = 0        # records written or deleted by the open transaction
        self.most_changes = 0   # ... by the largest of the batch's committed transactions
        # a table without a dictionary: (key, value) of the batch's values to train on
        self.samples: list[tuple[bytes, bytes]] | None = []
        self.trained: int | None = None   # a dictionary added by the uncommitted transaction

    def __enter__(self) -> LmdbWriteBatch:
        self._outer = self._table._begin_batch(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._outer:
            self._table._end_batch(self, commit=exc_type is None)

    def put(self, state_id: int, key_group: int, key: bytes, namespace: bytes,
            value: bytes) -> None:
        self._table.put(state_id, key_group, key, namespace, value)

    def remove(self, state_id: int, key_group: int, key: bytes, namespace: bytes) -> bool:
        return self._table.remove(state_id, key_group, key, namespace)


class LmdbBulkLoad(LmdbWriteBatch):
    """A write batch for a restore into this table (see :meth:`LmdbStateTable.bulk_load`).

    Besides the batch's own operations (which the replay's per-change path uses), it takes runs
    of ready-made LMDB records, :meth:`put_raw`, built by the caller with :meth:`prefix` (the
    key layout of the module docstring) — one journal entry per run, not per record. Between
    change sets the caller calls :meth:`step` with the bytes it is about to apply: once enough
    was applied the transaction is committed and a new one begun, and the map is grown ahead of
    the next writes, so the journal a full map replays never holds more than one step's runs.
    Not atomic as a whole: a restore that fails leaves part of its writes, and its table is
    cleared by the next restore (and carries no table marker, so nothing adopts it).
    """

    #: Commit once this many bytes of change sets were applied since the last commit.
    COMMIT_BYTES: Final = 16 << 20

    def __init__(self, table: LmdbStateTable) -> None:
        super().__init__(table)
        # as if a commit were due: the first step sizes the map for what comes
        self.pending = self.COMMIT_BYTES

    def __enter__(self) -> LmdbBulkLoad:
        super().__enter__()
        return self

    def prefix(self, key_group: int, state_id: int) -> bytes:
        """The first 4 bytes of every key of ``state_id`` in ``key_group``; a record's key is
        this, the u32 key length, the key and the namespace.

        Raises:
            KeyGroupError: ``key_group`` is outside the table's range.
        """
        t = self._table
        if type(key_group) is not int or not t._kg_start <= key_group <= t._kg_end:
            raise KeyGroupError(key_group, f"LmdbStateTable {t.path}", t._key_groups,
                                hint="route the key to the backend owning its key group")
        return _KG_SID.pack(key_group, check_state_id(state_id))

    def put_raw(self, records: list[tuple[bytes, bytes]]) -> None:
        """Store ``(raw key, value)`` records in order (later ones of the same key win).

        Raises:
            UsageError: a key longer than LMDB's limit (nothing after it is stored).
        """
        if records:
            t = self._table
            codec = t._codec
            if codec is None:
                t._write(("putmulti", records))
                return
            encode = codec.encode
            t._write(("putmulti", [(k, encode(v)) for k, v in records]))
            if codec.encode_number is None and self.samples is not None:
                for k, v in records:   # written raw: a dictionary trained now rewrites them
                    if MIN_COMPRESSED_VALUE_BYTES <= len(v) <= MAX_SAMPLE_BYTES:
                        t._sample(k, v)

    def step(self, nbytes: int) -> None:
        """A point between change sets, before ``nbytes`` more are applied: commit if enough
        was applied since the last commit, and make room in the map for what comes."""
        if self._outer:
            self._table._bulk_step(self, nbytes)


def _check_arguments(directory: object, key_groups: object, map_size_bytes: object,
                     max_map_size_bytes: object, sync: object, grow_wait_s: object,
                     readonly: object) -> str:
    """The constructor's arguments, checked before LMDB is touched (one place); returns the
    directory as a string. The size bounds are ``BackendOptions``'."""
    owner = "LmdbStateTable"
    path = check_optional_path(directory, "directory", owner)
    if path is None:
        raise ConfigTypeError("directory", directory, "a non-empty path", owner=owner)
    check_instance(key_groups, "key_groups", owner, KeyGroupRange)
    check_int(map_size_bytes, "map_size_bytes", owner, lo=MIN_LMDB_MAP_SIZE_BYTES,
              hi=MAX_LMDB_MAP_SIZE_BYTES)
    check_int(max_map_size_bytes, "max_map_size_bytes", owner, lo=MIN_LMDB_MAP_SIZE_BYTES,
              hi=MAX_LMDB_MAP_SIZE_BYTES)
    assert isinstance(map_size_bytes, int) and isinstance(max_map_size_bytes, int)
    if max_map_size_bytes < map_size_bytes:
        raise ConfigError("max_map_size_bytes", max_map_size_bytes,
                          f">= map_size_bytes ({map_size_bytes})", owner=owner)
    check_bool(sync, "sync", owner)
    check_number(grow_wait_s, "grow_wait_s", owner, lo=0.0, hi=3600.0, unit="seconds")
    check_bool(readonly, "readonly", owner)
    return str(Path(path))


class LmdbStateTable:
    """All states of one backend in one LMDB environment (directory), keyed by state id.

    Args:
        directory: the environment's directory (created if missing); one per owner.
        key_groups: the owner's key-group range; operations outside it raise ``KeyGroupError``.
        map_size_bytes: initial map size (an existing environment keeps its larger size).
        max_map_size_bytes: growth limit; beyond it ``StateTableFullError``.
        sync: fsync on commit. Off by default: the table is rebuilt from the last snapshot and
            the changelog after a machine crash, so durability here only costs latency.
        grow_wait_s: longest a writer waits for open snapshots before growing the map.
        readonly: open for reads and snapshots only (another process writes the table: the
            executor agent materializing a worker's table). Never takes LMDB's writer lock, so
            it cannot stall the writer; writes raise ``UsageError``.

    Raises:
        ConfigError: an argument out of range (sizes 1 MiB ... 64 TiB, ``map <= max``);
            ConfigTypeError: one of the wrong type.
        UnsupportedFormatError: the directory holds another key layout version.
    """

    def __init__(self, directory: str | os.PathLike[str], key_groups: KeyGroupRange, *,
                 map_size_bytes: int = DEFAULT_MAP_SIZE_BYTES,
                 max_map_size_bytes: int = DEFAULT_MAX_MAP_SIZE_BYTES,
                 sync: bool = False, grow_wait_s: float = DEFAULT_GROW_WAIT_S,
                 readonly: bool = False) -> None:
        self.path = _check_arguments(directory, key_groups, map_size_bytes, max_map_size_bytes,
                                     sync, grow_wait_s, readonly)
        self._key_groups = key_groups
        self._kg_start = key_groups.start
        self._kg_end = key_groups.end
        self._max_map_size = max_map_size_bytes
        self._grow_wait_s = grow_wait_s
        self._closed = False
        self._forked = False
        self._map_size = map_size_bytes
        self._readonly = readonly
        self._env: Any = self._open_env(sync=sync, readonly=readonly)
        self._pid = os.getpid()
        self._map_size = int(self._env.info()["map_size"])
        self._max_key = int(self._env.max_key_size())
        self._write_lock = threading.RLock()
        self._cv = threading.Condition(threading.Lock())
        self._active_reads = 0
        self._open_snapshots: weakref.WeakSet[LmdbTableSnapshot] = weakref.WeakSet()
        self._remapping = False
        self._open_scans = 0   # entries() iterations holding a read transaction of their own
        self._batch: LmdbWriteBatch | None = None
        self._sync = sync
        self._psize = int(self._env.stat()["psize"])
        self._layout: bytes | None = None       # None: a read-only open of an unwritten table
        self._codec: ValueCodec | None = None   # layout "2"'s values
        self._codec_lock = threading.Lock()
        self._check_layout()
        _OPEN_TABLES.add(self)
        log.info("opened LMDB state table %s (map %d bytes, max %d)", self.path, self._map_size,
                 self._max_map_size)

    def _open_env(self, *, sync: bool, readonly: bool) -> Any:
        """The LMDB environment in ``self.path`` (created unless ``readonly``)."""
        if not readonly:
            Path(self.path).mkdir(parents=True, exist_ok=True)
        elif not os.path.isfile(os.path.join(self.path, "data.mdb")):
            raise UsageError(f"LMDB state table {self.path} does not exist (a read-only open "
                             "needs a table some writer created)")
        try:
            return lmdb.open(self.path, map_size=self._map_size, subdir=True, sync=sync,
                             metasync=sync, readahead=False, lock=True, max_dbs=0,
                             readonly=readonly)
        except lmdb.Error as exc:
            if "already open" in str(exc):
                raise UsageError(
                    f"LMDB environment {self.path} is already open in this process (py-lmdb "
                    "allows one per process, and a forked child inherits the parent's: share "
                    "the open LmdbStateTable, or open it in a process that did not inherit it)"
                ) from exc
            raise self._translate(exc, "open") from exc

    # ------------------------------------------------------------------ properties

    @property
    def key_groups(self) -> KeyGroupRange:
        return self._key_groups

    @property
    def layout(self) -> bytes | None:
        """The key layout (``b"1"`` or ``b"2"``; None: a read-only open of a table no writer
        has opened yet)."""
        return self._layout

    @property
    def dictionaries(self) -> list[int]:
        """The numbers of the table's value dictionaries (layout ``"2"``), ascending."""
        return [] if self._codec is None else self._codec.numbers

    @property
    def map_size_bytes(self) -> int:
        """Current map size."""
        return self._map_size

    # ------------------------------------------------------------------ keys

    def _key(self, state_id: int, key_group: int, key: bytes, namespace: bytes) -> bytes:
        if type(key_group) is not int or not self._kg_start <= key_group <= self._kg_end:
            raise KeyGroupError(key_group, f"LmdbStateTable {self.path}", self._key_groups,
                                hint="route the key to the backend owning its key group")
        try:
            k = _PREFIX.pack(key_group, state_id, len(key)) + key + namespace
        except (struct.error, TypeError) as exc:
            check_state_id(state_id)
            raise UsageError(f"LmdbStateTable keys and namespaces must be bytes, got "
                             f"{type(key).__name__}/{type(namespace).__name__}") from exc
        if len(k) > self._max_key:
            raise UsageError(f"key ({len(key)} bytes) + namespace ({len(namespace)} bytes) exceed "
                             f"LMDB's key limit of {self._max_key - _PREFIX.size} bytes; use "
                             "shorter keys or the heap table")
        return k

    @staticmethod
    def _split(raw: bytes) -> tuple[int, int, bytes, bytes]:
        kg, sid, klen = _PREFIX.unpack_from(raw, 0)
        end = _PREFIX.size + klen
        return kg, sid, raw[_PREFIX.size:end], raw[end:]

    # ------------------------------------------------------------------ guards

    def _check_usable(self) -> None:
        if self._pid != _CURRENT_PID or self._forked:
            raise ForkedTableError(self.path, self._pid, os.getpid())
        if self._closed:
            raise ClosedError(f"LmdbStateTable {self.path}",
                              hint="reopen it with LmdbStateTable(directory, key_groups)")

    def _enter_read(self) -> None:
        with self._cv:
            while self._remapping:
                self._cv.wait()
            self._active_reads += 1

    def _exit_read(self) -> None:
        with self._cv:
            self._active_reads -= 1
            if self._active_reads == 0:
                self._cv.notify_all()

    def _batch_txn(self) -> Any:
        batch = self._batch
        if batch is not None and batch.thread == threading.get_ident():
            return batch.txn
        return None

    def _read_txn(self) -> Any:
        """A new read transaction; adopts a map grown by another process. Call under a read
        guard."""
        try:
            return self._env.begin(buffers=False)
        except lmdb.MapResizedError:
            self._exit_read()
            try:
                with self._write_lock:
                    self._remap(0)
            finally:
                self._enter_read()
            return self._env.begin(buffers=False)

    # ------------------------------------------------------------------ reads

    def get(self, state_id: int, key_group: int, key: bytes, namespace: bytes) -> bytes | None:
        """The value bytes, or None."""
        self._check_usable()
        k = self._key(state_id, key_group, key, namespace)
        txn = self._batch_txn()
        if txn is not None:
            return self._value(txn, k, txn.get(k))
        self._enter_read()
        try:
            with self._read_txn() as txn:
                return self._value(txn, k, txn.get(k))
        except lmdb.Error as exc:
            raise self._translate(exc, "get") from exc
        finally:
            self._exit_read()

    def _value(self, txn: Any, k: bytes, stored: bytes | None) -> bytes | None:
        """The value of the record ``k`` stored as ``stored`` (layout "2": decoded), read in
        ``txn``."""
        if stored is None:
            return None
        layout = self._layout
        if layout is None:
            self._load_codec(txn)
            layout = self._layout
        if layout == _LAYOUT_1:
            return stored
        codec = self._codec
        if codec is not None:
            try:
                return codec.decode(stored, k)
            except CorruptValueError:
                if len(stored) < 2 or codec.holds(stored[1]):
                    raise
        codec = self._load_codec(txn)   # another process trained a dictionary since we looked
        assert codec is not None
        return codec.decode(stored, k)

    def _decoder(self, txn: Any) -> _Decode | None:
        """``(key, stored) -> value`` for records read in ``txn``; None: stored as they are."""
        if self._layout == _LAYOUT_1:
            return None
        value = self._value
        return lambda k, v: value(txn, k, v)  # type: ignore[return-value]

    def _load_codec(self, txn: Any) -> ValueCodec | None:
        """Take the layout and the dictionaries the table holds as of ``txn`` (a read-only
        open learns them as the writer writes them); None for layout "1".

        Raises:
            UnsupportedFormatError: the layout record is of a layout this build does not read.
            CorruptValueError: a dictionary record does not load.
        """
        with self._codec_lock:
            if self._layout is None:
                found = txn.get(_LAYOUT_KEY)
                if found is None:
                    return None
                if found not in LAYOUT_VERSIONS:
                    raise UnsupportedFormatError(self.path, 0, f"LMDB key layout {found!r}",
                                                 f"layouts {LAYOUT_VERSIONS!r}")
                self._layout = found
            if self._layout == _LAYOUT_1:
                return None
            codec = self._codec if self._codec is not None else \
                ValueCodec(where=f"LMDB state table {self.path}")
            for number, data in read_dictionaries(txn):
                if not codec.holds(number):
                    codec.add(number, data)
            self._codec = codec
            return codec

    def contains(self, state_id: int, key_group: int, key: bytes, namespace: bytes) -> bool:
        return self.get(state_id, key_group, key, namespace) is not None

    def entries(self, state_id: int, key_group: int) -> Iterator[tuple[bytes, bytes, bytes]]:
        """``(key, namespace, value)`` of one state in one key group, from one read transaction
        (a consistent view as of the first ``next``), sorted by the key layout."""
        self._check_usable()
        check_state_id(state_id)
        prefix = self._key(state_id, key_group, b"", b"")[:_KG_SID.size]
        batch_txn = self._batch_txn()
        if batch_txn is not None:
            yield from _scan_prefix(batch_txn, prefix, self._decoder(batch_txn))
            return
        self._enter_read()
        try:
            txn = self._read_txn()
            with self._cv:   # counted under the read guard: a reopen waits for that first
                self._open_scans += 1
        finally:
            self._exit_read()
        try:
            start = prefix
            skip_first = False
            decode = self._decoder(txn)
            while True:
                self._enter_read()
                try:
                    chunk = _scan_chunk(txn, prefix, start, skip_first, _SCAN_CHUNK)
                finally:
                    self._exit_read()
                for raw, value in chunk:
                    _, _, k, ns = self._split(raw)
                    yield k, ns, value if decode is None else decode(raw, value)
                if len(chunk) < _SCAN_CHUNK:
                    return
                start, skip_first = chunk[-1][0], True
        finally:
            with self._cv:
                self._open_scans -= 1
            if not (self._forked or self._closed):
                txn.abort()

    def entries_up_to(self, state_id: int, key_group: int, key_len: int, max_key: bytes
                      ) -> list[tuple[bytes, bytes, bytes]]:
        """``(key, namespace, value)`` of one state in one key group whose key is ``key_len``
        bytes long and at most ``max_key``, in key order: one cursor seek, then a scan that
        stops at the first larger key (an ordered index: the timer service's due timers).
        Reads through this thread's open batch, if any."""
        self._check_usable()
        check_state_id(state_id)
        self._key(state_id, key_group, b"", b"")  # checks the key group
        prefix = _PREFIX.pack(key_group, state_id, key_len)
        txn = self._batch_txn()
        if txn is not None:
            return _scan_up_to(txn, prefix, key_len, max_key, self._decoder(txn))
        self._enter_read()
        try:
            with self._read_txn() as txn:
                return _scan_up_to(txn, prefix, key_len, max_key, self._decoder(txn))
        except lmdb.Error as exc:
            raise self._translate(exc, "entries_up_to") from exc
        finally:
            self._exit_read()

    def __len__(self) -> int:
        """Entries of all states in the key-group range."""
        self._check_usable()
        n = 0
        self._enter_read()
        try:
            with self._read_txn() as txn, txn.cursor() as cur:
                lo, hi = _KG_SID.pack(self._kg_start, 0), _KG_SID.pack(self._kg_end + 1, 0)
                if cur.set_range(lo):
                    for raw in cur.iternext(keys=True, values=False):
                        if raw >= hi:
                            break
                        n += 1
        finally:
            self._exit_read()
        return n

    def count_state(self, state_id: int) -> int:
        """Records of one state in the key-group range: a cursor seek per key group, then its
        keys (O(the state's records): for the internal indexes the progress figures leave out
        of the state rows)."""
        self._check_usable()
        check_state_id(state_id)
        n = 0
        self._enter_read()
        try:
            with self._read_txn() as txn, txn.cursor() as cur:
                for kg in range(self._kg_start, self._kg_end + 1):
                    prefix = _KG_SID.pack(kg, state_id)
                    if not cur.set_range(prefix):
                        break
                    for raw in cur.iternext(keys=True, values=False):
                        if not raw.startswith(prefix):
                            break
                        n += 1
        except lmdb.Error as exc:
            raise self._translate(exc, "count_state") from exc
        finally:
            self._exit_read()
        return n

    def fixed_records(self) -> int:
        """The layout and marker records (outside every key-group range): what ``stats``
        counts besides the states' records."""
        self._check_usable()
        n = 0
        self._enter_read()
        try:
            with self._read_txn() as txn, txn.cursor() as cur:
                if cur.set_range(b"\xff\xff"):
                    n = sum(1 for _ in cur.iternext(keys=True, values=False))
        except lmdb.Error as exc:
            raise self._translate(exc, "fixed_records") from exc
        finally:
            self._exit_read()
        return n

    def stats(self) -> dict[str, int]:
        """Cheap figures for progress reports, O(1) (no scan, unlike ``len``): ``entries``
        (records in the environment, the layout and marker records included), ``disk_bytes``
        (the pages in use: what a copy of the environment would hold) and ``memory_bytes`` (the
        same pages: the map through which they are read and written)."""
        self._check_usable()
        self._enter_read()
        try:
            st = self._env.stat()
            info = self._env.info()
        except lmdb.Error as exc:
            raise self._translate(exc, "stat") from exc
        finally:
            self._exit_read()
        used = (int(info["last_pgno"]) + 1) * int(st["psize"])
        # the state is read and written through the map: its pages in use are its memory too
        return {"entries": int(st["entries"]), "disk_bytes": used, "memory_bytes": used}

    # ------------------------------------------------------------------ writes

    def put(self, state_id: int, key_group: int, key: bytes, namespace: bytes,
            value: bytes) -> None:
        """Store ``value`` (bytes) for ``(state_id, key_group, key, namespace)``."""
        self._check_usable()
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise UsageError(f"LmdbStateTable values must be bytes, got {type(value).__name__}")
        k = self._key(state_id, key_group, key, namespace)
        codec = self._codec
        if codec is not None:
            if codec.encode_number is None and MIN_COMPRESSED_VALUE_BYTES <= len(value) \
                    <= MAX_SAMPLE_BYTES:
                self._sample(k, value)
            value = codec.encode(value)
        self._write(("put", k, value))

    def _sample(self, k: bytes, value: bytes | bytearray | memoryview) -> None:
        """Keep a value of this thread's open batch to train the table's dictionary on, and
        train once there are enough (:mod:`materializer.value_codec`, rule 1)."""
        batch = self._batch
        if batch is None or batch.samples is None or batch.thread != threading.get_ident():
            return
        batch.samples.append((k, bytes(value)))
        if len(batch.samples) >= TRAIN_MAX_SAMPLES:
            self._train(batch)

    def _train(self, batch: LmdbWriteBatch) -> None:
        """Train the table's dictionary on the batch's samples, write it, and rewrite the
        samples the batch stored raw, in the batch's transaction (on its thread)."""
        samples, batch.samples = batch.samples or [], None
        codec = self._codec
        data = train_dictionary(v for _, v in samples)
        if data is None or codec is None or codec.encode_number is not None:
            return
        number = 0
        codec.add(number, data)
        batch.trained = number
        self._write(("put", dictionary_key(number), data))
        for k, v in samples:
            if batch.txn.get(k) == _RAW_TAG + v:   # not overwritten or removed since
                self._write(("put", k, codec.encode(v)))

    def remove(self, state_id: int, key_group: int, key: bytes, namespace: bytes) -> bool:
        """Delete the entry; True if it existed."""
        self._check_usable()
        return bool(self._write(("del", self._key(state_id, key_group, key, namespace))))

    def clear_state(self, state_id: int) -> None:
        """Delete every entry of ``state_id`` in the key-group range (one transaction)."""
        self._check_usable()
        check_state_id(state_id)
        self._write(("clear", state_id))

    def write_marker(self, marker: bytes) -> None:
        """Store the table marker (:mod:`materializer.table_marker`). Inside a write batch it
        commits with the batch's state changes, which is the point of it."""
        self._check_usable()
        self._write(("put", _MARKER_KEY, bytes(marker)))

    def read_marker(self) -> bytes | None:
        """The table marker as of now (this thread's open batch included), or ``None``."""
        self._check_usable()
        txn = self._batch_txn()
        if txn is not None:
            return txn.get(_MARKER_KEY)  # type: ignore[no-any-return]
        self._enter_read()
        try:
            with self._read_txn() as txn:
                return txn.get(_MARKER_KEY)  # type: ignore[no-any-return]
        except lmdb.Error as exc:
            raise self._translate(exc, "read marker") from exc
        finally:
            self._exit_read()

    def put_many(self, items: list[tuple[int, int, bytes, bytes, bytes]]) -> None:
        """Store many ``(state_id, key_group, key, namespace, value)`` in one transaction."""
        with self.write_batch():
            for sid, kg, k, ns, v in items:
                self.put(sid, kg, k, ns, v)

    def write_batch(self) -> LmdbWriteBatch:
        """A context manager grouping this thread's writes into one transaction.

        Nested batches join the outer one. While a batch is open, writers on other threads wait
        for it. Reads on this thread see the batch's uncommitted writes.
        """
        self._check_usable()
        return LmdbWriteBatch(self)

    def bulk_load(self) -> LmdbBulkLoad:
        """A write batch for restoring into this table: runs of raw records and commits as it
        goes (see :class:`LmdbBulkLoad`). Nested in another batch it joins that one (and then
        neither commits early nor grows ahead)."""
        self._check_usable()
        return LmdbBulkLoad(self)

    def _bulk_step(self, batch: LmdbBulkLoad, nbytes: int) -> None:
        """Commit the bulk batch's transaction when it holds enough, and grow the map ahead of
        the next ``nbytes`` (x4: LMDB's pages and B-tree overhead over the change-set bytes of
        small records) plus one commit's worth; call with the batch open on this thread."""
        batch.pending += nbytes
        if batch.pending < LmdbBulkLoad.COMMIT_BYTES and nbytes * 4 < self._map_size // 8 \
                and batch.changes * self._psize < RELEASE_PAGES_BYTES:
            return
        self._commit_batch_txn(batch)
        batch.journal.clear()
        batch.pending = 0
        batch.most_changes = max(batch.most_changes, batch.changes)
        batch.changes = 0
        info = self._env.info()
        used = (int(info["last_pgno"]) + 1) * int(self._env.stat()["psize"])
        need = used + 4 * (nbytes + LmdbBulkLoad.COMMIT_BYTES)
        if need > self._map_size and self._map_size < self._max_map_size:
            size = self._map_size
            while size < 2 * need:
                size *= 2
            self._remap(min(size, self._max_map_size), wait_for_snapshots=True)
        batch.txn = self._begin_write()

    def _commit_batch_txn(self, batch: LmdbWriteBatch) -> None:
        """Commit the batch's transaction (a full map: grow and replay its journal, retry)."""
        while True:
            try:
                batch.txn.commit()
                batch.trained = None
                return
            except lmdb.MapFullError:
                batch.txn, _ = self._grow_and_replay(batch)
            except lmdb.Error as exc:
                batch.txn.abort()
                raise self._translate(exc, "commit") from exc

    def _begin_batch(self, batch: LmdbWriteBatch) -> bool:
        if self._readonly:
            raise UsageError(f"LMDB state table {self.path} was opened read-only")
        me = threading.get_ident()
        current = self._batch
        if current is not None and current.thread == me:
            return False  # nested: join the outer batch
        self._write_lock.acquire()
        try:
            self._check_usable()
            batch.thread = me
            batch.txn = self._begin_write()
            self._batch = batch
        except BaseException:
            self._write_lock.release()
            raise
        return True

    def _end_batch(self, batch: LmdbWriteBatch, *, commit: bool) -> None:
        try:
            if self._forked or self._closed:
                return
            if not commit:
                batch.txn.abort()
            else:
                if batch.samples is not None and len(batch.samples) >= TRAIN_MIN_VALUES:
                    try:
                        self._train(batch)
                    except BaseException:
                        batch.txn.abort()
                        raise
                self._commit_batch_txn(batch)
            batch.txn = None
            if max(batch.most_changes, batch.changes) * self._psize >= RELEASE_PAGES_BYTES:
                self._release_pages()
        finally:
            if batch.trained is not None and self._codec is not None:
                self._codec.discard(batch.trained)   # its transaction did not commit
                batch.trained = None
            self._batch = None
            batch.txn = None
            batch.journal.clear()
            self._write_lock.release()

    def _release_pages(self) -> None:
        """Reopen the environment, so LMDB frees the page buffers a large transaction left
        (the module docstring); call with the write lock held and no write transaction open.
        Skipped while a snapshot or a scan of this process holds a read transaction (closing
        the environment would end it): the next large batch tries again."""
        with self._cv:
            if len(self._open_snapshots) or self._open_scans:
                return
            self._remapping = True
            try:
                while self._active_reads:
                    self._cv.wait()
                if len(self._open_snapshots) or self._open_scans:
                    return   # one began before the guard went up
                self._env.close()
                try:
                    self._env = self._open_env(sync=self._sync, readonly=False)
                except BaseException:
                    self._closed = True   # no environment left: every later call says so
                    raise
                self._map_size = int(self._env.info()["map_size"])
            finally:
                self._remapping = False
                self._cv.notify_all()
        # the page buffers went back to the heap, where glibc keeps them: give them back
        release_free_memory()
        log.debug("LMDB state table %s reopened to free a large transaction's pages",
                  self.path)

    def _begin_write(self) -> Any:
        """A write transaction; call with the write lock held."""
        try:
            return self._env.begin(write=True, buffers=False)
        except lmdb.MapResizedError:
            self._remap(0)
            return self._env.begin(write=True, buffers=False)

    def _write(self, op: tuple[Any, ...]) -> Any:
        if self._readonly:
            raise UsageError(f"LMDB state table {self.path} was opened read-only")
        batch = self._batch
        if batch is not None and batch.thread == threading.get_ident():
            journal = batch.journal
            if journal.room > 0 and journal.file is None:   # _Journal.append, inline
                journal.ops.append(op)
                journal.room -= 64 + len(op[1]) + len(op[2]) if op[0] == "put" \
                    else _op_bytes(op)
            else:
                journal.append(op)
            batch.changes += len(op[1]) if op[0] == "putmulti" else 1
            try:
                return self._apply(batch.txn, op)
            except lmdb.MapFullError:
                batch.txn, result = self._grow_and_replay(batch)
                return result
            except lmdb.Error as exc:
                raise self._translate(exc, op[0]) from exc
        with self._write_lock:
            self._check_usable()
            while True:
                txn = self._begin_write()
                try:
                    result = self._apply(txn, op)
                    txn.commit()
                    return result
                except lmdb.MapFullError:
                    txn.abort()
                    self._grow()
                except lmdb.Error as exc:
                    txn.abort()
                    raise self._translate(exc, op[0]) from exc
                except BaseException:
                    txn.abort()
                    raise

    def _apply(self, txn: Any, op: tuple[Any, ...]) -> Any:
        kind = op[0]
        if kind == "put":
            return txn.put(op[1], op[2])
        if kind == "putmulti":
            with txn.cursor() as cur:
                cur.putmulti(op[1])
            return None
        if kind == "del":
            return txn.delete(op[1])
        lo = _KG_SID.pack
        with txn.cursor() as cur:
            for kg in range(self._kg_start, self._kg_end + 1):
                prefix = lo(kg, op[1])
                if not cur.set_range(prefix):
                    break
                while cur.key()[:_KG_SID.size] == prefix:
                    if not cur.delete():
                        break
        return None

    def _grow_and_replay(self, batch: LmdbWriteBatch) -> tuple[Any, Any]:
        """MapFull inside a batch: abort, grow, replay the journal into a new transaction.

        Returns the new transaction and the result of the journal's last operation.
        """
        batch.txn.abort()
        while True:
            self._grow()
            txn = self._begin_write()
            try:
                result = None
                for op in batch.journal:
                    result = self._apply(txn, op)
                return txn, result
            except lmdb.MapFullError:
                txn.abort()

    def _grow(self) -> None:
        """Double the map (up to the max); call with the write lock held and no write txn."""
        if self._map_size >= self._max_map_size:
            raise StateTableFullError(self.path, self._map_size, setting="max_map_size_bytes")
        new_size = min(self._map_size * 2, self._max_map_size)
        self._remap(new_size, wait_for_snapshots=True)

    def _remap(self, new_size: int, *, wait_for_snapshots: bool = True) -> None:
        """Resize (``0``: adopt another process's size). py-lmdb invalidates every open
        transaction, so wait for snapshots and in-flight reads first."""
        deadline = time.monotonic() + self._grow_wait_s
        with self._cv:
            while wait_for_snapshots and len(self._open_snapshots):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StateTableFullError(
                        self.path, self._map_size,
                        setting=f"max_map_size_bytes or release the {len(self._open_snapshots)} "
                                f"open snapshot(s) sooner (waited {self._grow_wait_s} s to grow)")
                self._cv.wait(left)
            self._remapping = True
            while self._active_reads:
                self._cv.wait()
            try:
                self._env.set_mapsize(new_size)
                self._map_size = int(self._env.info()["map_size"])
            except lmdb.Error as exc:
                raise self._translate(exc, "set_mapsize") from exc
            finally:
                self._remapping = False
                self._cv.notify_all()
        log.info("LMDB state table %s map size now %d bytes", self.path, self._map_size)

    # ------------------------------------------------------------------ snapshots

    def snapshot(self) -> LmdbTableSnapshot:
        """A read transaction over the whole table; write it out on any thread.

        First grows the map to twice the used size when possible (no batch open, no other
        snapshot), so writers rarely have to wait for this snapshot before growing.
        """
        self._check_usable()
        self._ensure_headroom()
        self._enter_read()
        try:
            txn = self._read_txn()
            snap = LmdbTableSnapshot(self, txn)
            with self._cv:
                self._open_snapshots.add(snap)
        except lmdb.Error as exc:
            raise self._translate(exc, "snapshot") from exc
        finally:
            self._exit_read()
        return snap

    def _ensure_headroom(self) -> None:
        if self._readonly or self._batch is not None or len(self._open_snapshots):
            return
        if not self._write_lock.acquire(blocking=False):
            return
        try:
            info = self._env.info()
            used = (int(info["last_pgno"]) + 1) * int(self._env.stat()["psize"])
            if used * 2 > self._map_size and self._map_size < self._max_map_size:
                self._remap(min(max(self._map_size * 2, used * 4), self._max_map_size),
                            wait_for_snapshots=False)
        finally:
            self._write_lock.release()

    def _snapshot_done(self, snap: LmdbTableSnapshot) -> None:
        with self._cv:
            self._open_snapshots.discard(snap)
            self._cv.notify_all()

    def load_snapshot(self, reader: SnapshotReader, decode: DecodeFn | None = None,
                      key_groups: KeyGroupRange | None = None) -> int:
        """Put the entries of a snapshot object's key groups (``key_groups ∩ ours``) into the
        table, one transaction per key group. ``decode`` must be None (values stay bytes).

        Returns:
            entries loaded.
        """
        if decode is not None:
            raise UsageError("LmdbStateTable stores bytes: load_snapshot takes no decode")
        self._check_usable()
        wanted = self._key_groups if key_groups is None else \
            self._key_groups.intersection(key_groups)
        count = 0
        for kg, entries in reader.read(wanted):
            with self.write_batch():
                for sid, k, ns, v in entries:
                    self.put(sid, kg, k, ns, v)
                    count += 1
        return count

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the environment (open snapshots become unusable). Idempotent."""
        if self._closed:
            return
        self._closed = True
        _OPEN_TABLES.discard(self)
        if self._forked or self._pid != os.getpid():
            return  # never touch the parent's environment from a child
        self._env.close()
        log.info("closed LMDB state table %s", self.path)

    def __enter__(self) -> LmdbStateTable:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _abandon_in_child(self) -> None:
        self._forked = True
        _ABANDONED_IN_CHILD.append(self._env)
        _ABANDONED_IN_CHILD.extend(s._txn for s in list(self._open_snapshots))
        if self._batch is not None:
            _ABANDONED_IN_CHILD.append(self._batch.txn)

    def _check_layout(self) -> None:
        """Take the table's layout and dictionaries (a new table: write layout "2")."""
        if not self._readonly:
            self._write_layout()
        try:
            with self._env.begin() as txn:
                self._load_codec(txn)
        except DstlError:
            self._env.close()
            self._closed = True
            raise

    def _write_layout(self) -> bytes | None:
        """Set the layout record of a new table; return what an existing table has."""
        with self._write_lock:
            txn = self._begin_write()
            try:
                found: bytes | None = txn.get(_LAYOUT_KEY)
                if found is None:
                    txn.put(_LAYOUT_KEY, _LAYOUT_VERSION)
                    txn.commit()
                    return None
                txn.abort()
                return found
            except BaseException:
                txn.abort()
                raise

    def _translate(self, exc: lmdb.Error, op: str) -> Exception:
        if isinstance(exc, lmdb.MapFullError):
            return StateTableFullError(self.path, self._map_size, setting="max_map_size_bytes")
        if isinstance(exc, lmdb.BadValsizeError):
            return UsageError(f"LmdbStateTable {self.path}: {op} failed: a key + namespace "
                              f"exceed LMDB's key limit of {self._max_key - _PREFIX.size} bytes "
                              f"({exc}); use shorter keys or the heap table")
        if isinstance(exc, lmdb.DiskError) or "No space left" in str(exc):
            return LocalDiskFullError(f"LMDB state table {self.path}: {op} failed: {exc} "
                                      "(free local disk space)", path=self.path)
        if self._closed:
            return ClosedError(f"LmdbStateTable {self.path}", hint="reopen it")
        return StateError(f"LMDB state table {self.path}: {op} failed: {exc}")


def read_dictionaries(txn: Any) -> list[tuple[int, bytes]]:
    """The dictionary records ``(number, record)`` of the environment read in ``txn``."""
    out: list[tuple[int, bytes]] = []
    with txn.cursor() as cur:
        if not cur.set_range(DICT_KEY_PREFIX):
            return out
        for raw, value in cur.iternext():
            if not raw.startswith(DICT_KEY_PREFIX):
                break
            number = dictionary_number(raw)
            if number is not None:
                out.append((number, value))
    return out


def _scan_prefix(txn: Any, prefix: bytes, decode: _Decode | None
                 ) -> Iterator[tuple[bytes, bytes, bytes]]:
    with txn.cursor() as cur:
        if not cur.set_range(prefix):
            return
        for raw, value in cur.iternext():
            if raw[:len(prefix)] != prefix:
                return
            _, _, k, ns = LmdbStateTable._split(raw)
            yield k, ns, value if decode is None else decode(raw, value)


def _scan_up_to(txn: Any, prefix: bytes, key_len: int, max_key: bytes, decode: _Decode | None
                ) -> list[tuple[bytes, bytes, bytes]]:
    out: list[tuple[bytes, bytes, bytes]] = []
    n, end = len(prefix), len(prefix) + key_len
    with txn.cursor() as cur:
        if not cur.set_range(prefix):
            return out
        for raw, value in cur.iternext():
            if raw[:n] != prefix or raw[n:end] > max_key:
                break
            out.append((raw[n:end], raw[end:], value if decode is None else decode(raw, value)))
    return out


def _scan_chunk(txn: Any, prefix: bytes, start: bytes, skip_first: bool,
                limit: int) -> list[tuple[bytes, bytes]]:
    """Up to ``limit`` raw ``(key, value)`` pairs with ``prefix`` from ``start`` on."""
    out: list[tuple[bytes, bytes]] = []
    n = len(prefix)
    with txn.cursor() as cur:
        if not cur.set_range(start):
            return out
        for raw, value in cur.iternext():
            if skip_first and raw == start:
                skip_first = False
                continue
            if raw[:n] != prefix or len(out) >= limit:
                break
            out.append((raw, value))
    return out


class LmdbTableSnapshot(TablesSnapshot):
    """A read transaction over an :class:`LmdbStateTable`; write it out once, on any thread."""

    def __init__(self, table: LmdbStateTable, txn: Any) -> None:
        super().__init__(table.key_groups)
        self._table = table
        self._txn = txn
        self._released = False

    def entries(self, key_group: int) -> list[SnapshotEntry]:
        """All states' ``(state id, key, namespace, value)`` of ``key_group`` at the snapshot."""
        if self._released:
            raise ClosedError("LMDB table snapshot", hint="take a new snapshot")
        if key_group not in self._key_groups:
            raise KeyGroupError(key_group, "LmdbTableSnapshot", self._key_groups)
        table = self._table
        table._enter_read()
        try:
            return _collect_key_group(self._txn, key_group, table._decoder(self._txn))
        except lmdb.Error as exc:
            raise table._translate(exc, "snapshot read") from exc
        finally:
            table._exit_read()

    def _blocks(self, encode: EncodeFn | None) -> Iterator[tuple[int, list[SnapshotEntry]]]:
        if encode is not None:
            raise UsageError("LmdbStateTable snapshots hold bytes: write() takes no encode")
        table = self._table
        kg = self._key_groups.start
        end = self._key_groups.end
        while kg <= end:
            if self._released:
                raise ClosedError("LMDB table snapshot", hint="take a new snapshot")
            table._enter_read()
            try:
                # Jump straight to the next non-empty key group.
                with self._txn.cursor() as cur:
                    if not cur.set_range(_KG_SID.pack(kg, 0)):
                        return
                    kg = _KG_SID.unpack_from(cur.key(), 0)[0]
                if kg > end:
                    return
                entries = _collect_key_group(self._txn, kg, table._decoder(self._txn))
            except lmdb.Error as exc:
                raise table._translate(exc, "snapshot read") from exc
            finally:
                table._exit_read()
            yield kg, entries
            kg += 1

    def copy_to(self, fd: int) -> None:
        """Write a compacted copy of the whole environment, as of this snapshot's read
        transaction, to the file descriptor ``fd`` (a file or a pipe: a file snapshot,
        :mod:`materializer.file_snapshot`), :meth:`copy_size` bytes. Writers go on meanwhile;
        the marker and the layout record are in the copy (same transaction as the entries)."""
        if self._released:
            raise ClosedError("LMDB table snapshot", hint="take a new snapshot")
        table = self._table
        table._enter_read()
        try:
            table._env.copyfd(fd, compact=True, txn=self._txn)
        except lmdb.Error as exc:
            raise table._translate(exc, "snapshot copy") from exc
        finally:
            table._exit_read()

    def _main_db(self) -> Any:
        """The main database's handle, looked up in this snapshot's own read transaction:
        without one py-lmdb begins another, which LMDB refuses with ``MDB_MAP_RESIZED`` once
        the writer (another process: the agent materializes a worker's table) has grown the
        table beyond this process's map — while this transaction still reads its own pages
        fine. Call under the read guard."""
        return self._table._env.open_db(txn=self._txn)

    def copy_size(self) -> int:
        """The size of what :meth:`copy_to` writes, known before it runs: a compacting copy
        holds the two meta pages and the pages of the tree, nothing else (no free pages, no
        free list), so :mod:`materializer.file_snapshot` can stream it without a temporary
        file."""
        if self._released:
            raise ClosedError("LMDB table snapshot", hint="take a new snapshot")
        table = self._table
        table._enter_read()
        try:
            st = self._txn.stat(self._main_db())
        except lmdb.Error as exc:
            raise table._translate(exc, "snapshot stat") from exc
        finally:
            table._exit_read()
        tree = int(st["branch_pages"]) + int(st["leaf_pages"]) + int(st["overflow_pages"])
        return (2 + tree) * int(st["psize"])

    def get_many(self, keys: Iterable[tuple[int, int, bytes, bytes]]) -> list[bytes | None]:
        """The values of ``(state id, key group, key, namespace)`` entries as of this snapshot
        (``None``: absent), in the order given: what a delta of these entries holds."""
        if self._released:
            raise ClosedError("LMDB table snapshot", hint="take a new snapshot")
        table = self._table
        make = table._key
        table._enter_read()
        try:
            get = self._txn.get
            decode = table._decoder(self._txn)
            if decode is None:
                return [get(make(sid, kg, k, ns)) for sid, kg, k, ns in keys]
            out: list[bytes | None] = []
            for sid, kg, k, ns in keys:
                raw = make(sid, kg, k, ns)
                stored = get(raw)
                out.append(None if stored is None else decode(raw, stored))
            return out
        except lmdb.Error as exc:
            raise table._translate(exc, "snapshot read") from exc
        finally:
            table._exit_read()

    def records(self) -> Generator[tuple[bytes, bytes], None, None]:
        """Every raw ``(key, value)`` record of the environment at the snapshot, in key order
        (the reserved records last), values as stored (layout "2": encoded): what a compacting
        copy holds, for a copy that repacks them
        (:class:`materializer.lmdb_files.PackedEnvironment`)."""
        if self._released:
            raise ClosedError("LMDB table snapshot", hint="take a new snapshot")
        table = self._table
        table._enter_read()
        try:
            with self._txn.cursor() as cur:
                if cur.first():
                    yield from cur.iternext()
        except lmdb.Error as exc:
            raise table._translate(exc, "snapshot read") from exc
        finally:
            table._exit_read()

    def leaf_fill(self) -> float:
        """How full the leaf pages are, estimated: the leaf nodes' bytes (LMDB's node header,
        key, value or its overflow page number, slot) of up to ``_FILL_SAMPLE`` records at
        eight places of the key-group range, scaled to every entry, over the leaf pages' room.
        1.0 for a table of fewer than 64 leaf pages (nothing worth packing)."""
        if self._released:
            raise ClosedError("LMDB table snapshot", hint="take a new snapshot")
        table = self._table
        table._enter_read()
        try:
            st = self._txn.stat(self._main_db())
            leaves, psize = int(st["leaf_pages"]), int(st["psize"])
            if leaves < 64:
                return 1.0
            nodemax = ((psize - _PAGE_HEADER) // 2 & ~1) - 2   # LMDB's me_nodemax
            sizes: list[int] = []
            kgs = self._key_groups
            per_place = _FILL_SAMPLE // 8
            with self._txn.cursor() as cur:
                for i in range(8):
                    kg = kgs.start + (kgs.end - kgs.start) * i // 8
                    if not cur.set_range(_KG_SID.pack(kg, 0)):
                        break
                    for n, (k, v) in enumerate(cur.iternext()):
                        node = 8 + len(k) + len(v)
                        node = 8 + len(k) + 8 if node > nodemax else node
                        sizes.append(node + (node & 1) + 2)
                        if n + 1 >= per_place:
                            break
        except lmdb.Error as exc:
            raise table._translate(exc, "snapshot stat") from exc
        finally:
            table._exit_read()
        if not sizes:
            return 1.0
        used = int(st["entries"]) * sum(sizes) / len(sizes)
        return min(1.0, used / (leaves * (psize - _PAGE_HEADER)))

    def entry_count(self) -> int:
        """Records in the table as of this snapshot (the layout and marker records included)."""
        if self._released:
            raise ClosedError("LMDB table snapshot", hint="take a new snapshot")
        table = self._table
        table._enter_read()
        try:
            return int(self._txn.stat(self._main_db())["entries"])
        except lmdb.Error as exc:
            raise table._translate(exc, "snapshot stat") from exc
        finally:
            table._exit_read()

    @property
    def layout(self) -> str:
        """The table's key layout (``"1"`` or ``"2"``), for a snapshot file's metadata."""
        return (self._table.layout or _LAYOUT_VERSION).decode()

    def reserved_records(self) -> int:
        """The reserved records (key group ``0xFFFF``: layout, marker, dictionaries) as of
        this snapshot: what :meth:`entry_count` counts besides the states' entries."""
        if self._released:
            raise ClosedError("LMDB table snapshot", hint="take a new snapshot")
        table = self._table
        table._enter_read()
        try:
            with self._txn.cursor() as cur:
                if not cur.set_range(b"\xff\xff"):
                    return 0
                return sum(1 for _ in cur.iternext(keys=True, values=False))
        except lmdb.Error as exc:
            raise table._translate(exc, "snapshot read") from exc
        finally:
            table._exit_read()

    def marker(self) -> bytes | None:
        """The table marker as of this snapshot (same read transaction as the entries)."""
        if self._released:
            raise ClosedError("LMDB table snapshot", hint="take a new snapshot")
        table = self._table
        table._enter_read()
        try:
            return self._txn.get(_MARKER_KEY)  # type: ignore[no-any-return]
        except lmdb.Error as exc:
            raise table._translate(exc, "snapshot read") from exc
        finally:
            table._exit_read()

    def release(self) -> None:
        """Abort the read transaction. Idempotent."""
        if self._released:
            return
        self._released = True
        table = self._table
        if not table._forked and table._pid == os.getpid() and not table._closed:
            self._txn.abort()
        table._snapshot_done(self)


def _collect_key_group(txn: Any, key_group: int, decode: _Decode | None
                       ) -> list[SnapshotEntry]:
    out: list[SnapshotEntry] = []
    append = out.append
    unpack = _PREFIX.unpack_from
    psize = _PREFIX.size
    with txn.cursor() as cur:
        if not cur.set_range(_KG_SID.pack(key_group, 0)):
            return out
        for raw, value in cur.iternext():
            kg, sid, klen = unpack(raw, 0)
            if kg != key_group:
                break
            end = psize + klen
            append((sid, raw[psize:end], raw[end:],
                    value if decode is None else decode(raw, value)))
    return out
