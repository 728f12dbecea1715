"""The multi-state facade a keyed backend writes into: heap or LMDB behind one set of operations.

Theory of operation
-------------------
A keyed backend has several registered states, each with a small integer *state id*. It talks to
its state tables only through the operations of :class:`StateTables`:

* ``get / put / remove / contains / entries / clear_state`` addressed by ``(state_id, key_group,
  key, namespace)``; ``write_batch()`` groups writes (one LMDB transaction; a no-op on the heap);
* ``snapshot()`` -> a :class:`TablesSnapshot`, written out once (on any thread, while the writer
  continues) with ``write(sink, metadata=..., encode=...)`` into the snapshot object format of
  :mod:`materializer.snapshot_format`, key group by key group, then released;
* ``load_snapshot(reader, decode=..., key_groups=...)`` reads only the wanted key groups of a
  snapshot object through a :class:`SnapshotReader` (whole bytes, or ranged reads of a store).

Two implementations: :class:`HeapStateTables` (one :class:`CopyOnWriteStateTable` per state id;
keys, namespaces and states are Python objects; ``encode``/``decode`` convert them to bytes at the
snapshot boundary) and :class:`materializer.lmdb_table.LmdbStateTable` (everything is bytes
already; ``encode``/``decode`` must be ``None``). Because both write the same object format, a heap
snapshot loads into LMDB and back.
"""

from __future__ import annotations

import contextlib
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

from dstl.errors import ClosedError, ObjectNotFoundError, TruncatedObjectError, UsageError
from dstl.keygroups import KeyGroupRange
from dstl.stores.base import BlobStore
from materializer.cow_map import DEFAULT_CAPACITY
from materializer.cow_table import CopyOnWriteStateTable, CopyOnWriteStateTableSnapshot
from materializer.snapshot_format import (
    FOOTER_SIZE,
    HEADER_SIZE,
    MAX_STATE_ID,
    TAIL_READ_BYTES,
    SnapshotEncoder,
    SnapshotEntry,
    SnapshotIndex,
    decode_footer,
    decode_index,
    decode_metadata_block,
    decode_snapshot,
    iter_block,
)

__all__ = [
    "BlobRangeSource",
    "BytesSource",
    "DecodeFn",
    "EncodeFn",
    "HeapStateTables",
    "HeapTablesSnapshot",
    "RangeSource",
    "SnapshotReader",
    "SnapshotWriteStats",
    "StateTables",
    "TablesSnapshot",
    "check_state_id",
]

#: ``encode(state_id, key, namespace, state) -> (key bytes, namespace bytes, value bytes)``.
EncodeFn = Callable[[int, Any, Any, Any], tuple[bytes, bytes, bytes]]
#: ``decode(state_id, key bytes, namespace bytes, value bytes) -> (key, namespace, state)``.
DecodeFn = Callable[[int, bytes, bytes, bytes], tuple[Any, Any, Any]]
#: Receives the snapshot object's bytes in order (``file.write``, ``list.append``, ...).
Sink = Callable[[bytes], object]


def check_state_id(state_id: int) -> int:
    """Return ``state_id`` if it is an int in ``[0, 65535]`` (u16 in both key layout and format)."""
    if type(state_id) is not int or not 0 <= state_id <= MAX_STATE_ID:
        raise UsageError(f"state id {state_id!r} is invalid: expected an int in "
                         f"[0, {MAX_STATE_ID}] (assign ids when states are registered)")
    return state_id


@dataclass(frozen=True, slots=True)
class SnapshotWriteStats:
    """What one snapshot write-out produced."""

    bytes_written: int
    entries: int
    blocks: int


# --------------------------------------------------------------------------- snapshots


class TablesSnapshot(ABC):
    """A consistent snapshot of all states of a :class:`StateTables`; written out once.

    Subclasses provide the entries per key group; the write-out is shared so both tables produce
    identical objects for identical contents (entries within a block: ascending state id).
    """

    def __init__(self, key_groups: KeyGroupRange) -> None:
        self._key_groups = key_groups
        self._written = False

    @property
    def key_groups(self) -> KeyGroupRange:
        return self._key_groups

    @abstractmethod
    def _blocks(self, encode: EncodeFn | None) -> Iterator[tuple[int, Iterable[SnapshotEntry]]]:
        """Non-empty key groups in ascending order with their encoded entries."""

    def _after_key_group(self, key_group: int) -> None:
        """Called once a key group's block is encoded (the heap releases its map snapshots)."""
        _ = key_group  # nothing to give back per key group by default (LMDB: one read txn)

    @abstractmethod
    def release(self) -> None:
        """Give back what the snapshot pins (map versions / the read transaction). Idempotent."""

    def write(self, sink: Sink, *, metadata: bytes = b"", encode: EncodeFn | None = None,
              zstd_level: int = 1, max_block_bytes: int | None = None) -> SnapshotWriteStats:
        """Write the snapshot object to ``sink``, key group by key group, then release.

        Safe to call on another thread than the writer's. The snapshot is released when this
        returns or raises (a snapshot is written once).

        Args:
            sink: receives the object's bytes in order.
            metadata: opaque bytes describing the states (stored in the metadata block).
            encode: heap only: turns ``(state_id, key, namespace, state)`` into three byte
                strings. ``None``: keys, namespaces and states must already be bytes.
            zstd_level: zstd level of the blocks.
            max_block_bytes: the limit on a block's content (default the format's).

        Raises:
            ClosedError: already written or released.
            UsageError: an entry is not bytes (pass ``encode``) or the encoder rejected it.
        """
        if self._written:
            raise ClosedError("state tables snapshot", hint="a snapshot is written once; take a "
                                                             "new one")
        self._written = True
        try:
            enc = SnapshotEncoder(self._key_groups, metadata, zstd_level=zstd_level,
                                  max_block_bytes=max_block_bytes)
            sink(enc.start())
            blocks = 0
            for kg, entries in self._blocks(encode):
                chunk = enc.add_key_group(kg, entries)
                self._after_key_group(kg)
                if chunk:
                    blocks += 1
                    sink(chunk)
            sink(enc.finish())
            return SnapshotWriteStats(enc.bytes_written, enc.entries_written, blocks)
        finally:
            self.release()

    def to_bytes(self, *, metadata: bytes = b"", encode: EncodeFn | None = None,
                 zstd_level: int = 1, max_block_bytes: int | None = None) -> bytes:
        """:meth:`write` into memory and return the object."""
        parts: list[bytes] = []
        self.write(parts.append, metadata=metadata, encode=encode, zstd_level=zstd_level,
                   max_block_bytes=max_block_bytes)
        return b"".join(parts)

    def __enter__(self) -> TablesSnapshot:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


# --------------------------------------------------------------------------- reading


@runtime_checkable
class RangeSource(Protocol):
    """Where a snapshot object's bytes come from: its size and ranged reads."""

    def size(self) -> int: ...

    def read(self, offset: int, length: int) -> bytes: ...


class BytesSource:
    """A snapshot object held in memory."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def size(self) -> int:
        return len(self.data)

    def read(self, offset: int, length: int) -> bytes:
        return self.data[offset:offset + length]


class BlobRangeSource:
    """Ranged reads of one object of a :class:`~dstl.stores.base.BlobStore`."""

    def __init__(self, store: BlobStore, key: str, size: int | None = None) -> None:
        self._store = store
        self.key = key
        self._size = size

    def size(self) -> int:
        if self._size is None:
            info = self._store.head(self.key)
            if info is None:
                raise ObjectNotFoundError(f"snapshot object {self.key} does not exist",
                                          key=self.key)
            self._size = info.size
        return self._size

    def read(self, offset: int, length: int) -> bytes:
        return self._store.get_range(self.key, offset, length)


class SnapshotReader:
    """Reads a snapshot object: its metadata, its key-group range, and chosen key groups only.

    With ``bytes`` the whole object is verified at once (object crc included). With a
    :class:`RangeSource` it fetches the tail (footer + usually the index), then only the blocks
    asked for; every block verifies itself.

    Args:
        source: the object's bytes or a ranged source.
        key: the object's name, used in error messages.
        max_block_bytes: the limit on a block's content
            (``BackendOptions.max_snapshot_block_bytes``; default the format's).
    """

    def __init__(self, source: bytes | bytearray | memoryview | RangeSource, *,
                 key: str = "<snapshot>", max_block_bytes: int | None = None) -> None:
        self.key = key
        self._max_block_bytes = max_block_bytes
        if isinstance(source, (bytes, bytearray, memoryview)):
            contents = decode_snapshot(source, key=key, max_block_bytes=max_block_bytes)
            self._whole: dict[int, list[SnapshotEntry]] | None = contents.blocks
            self._metadata: bytes | None = contents.metadata
            self._key_groups = contents.key_groups
            self._source: RangeSource | None = None
            self._index: SnapshotIndex | None = None
            return
        self._whole = None
        self._metadata = None
        self._source = source
        size = source.size()
        tail_len = min(size, TAIL_READ_BYTES)
        tail = source.read(size - tail_len, tail_len)
        if len(tail) != tail_len:
            raise TruncatedObjectError(key, size - tail_len, tail_len, len(tail), "tail read")
        footer = decode_footer(tail, size, key=key)
        start = footer.index_offset - (size - tail_len)
        if start >= 0:
            index_bytes = tail[start:len(tail) - FOOTER_SIZE]
        else:
            index_bytes = source.read(footer.index_offset, footer.index_length)
        self._index = decode_index(index_bytes, footer, key=key)
        self._key_groups = self._index.key_groups

    @property
    def key_groups(self) -> KeyGroupRange:
        """The key-group range the snapshot covers."""
        return self._key_groups

    @property
    def metadata(self) -> bytes:
        """The caller bytes of the metadata block."""
        if self._metadata is None:
            assert self._index is not None and self._source is not None
            m = self._index.metadata
            self._metadata = decode_metadata_block(self._source.read(m.offset, m.length), m,
                                                   key=self.key,
                                                   max_block_bytes=self._max_block_bytes)
        return self._metadata

    @property
    def metadata_offset(self) -> int:
        """Where the metadata block starts in the object (for error messages)."""
        return self._index.metadata.offset if self._index is not None else HEADER_SIZE

    def read_located(self, key_groups: KeyGroupRange | None = None
                     ) -> Iterator[tuple[int, int, Iterable[SnapshotEntry]]]:
        """:meth:`read`, each block with its offset in the object (0 for a whole-bytes
        source, which verified every block already)."""
        if self._whole is not None:
            for kg, entries in self.read(key_groups):
                yield kg, 0, entries
            return
        assert self._index is not None and self._source is not None
        for b in self._index.blocks_for(key_groups):
            record = self._source.read(b.offset, b.length)
            yield b.key_group, b.offset, iter_block(record, b, key=self.key,
                                                    max_block_bytes=self._max_block_bytes)
            del record

    def read(self, key_groups: KeyGroupRange | None = None
             ) -> Iterator[tuple[int, Iterable[SnapshotEntry]]]:
        """``(key group, entries)`` of the non-empty key groups in ``key_groups`` (default all).

        With a ranged source, each block is fetched and verified when it is reached and its
        entries come one at a time (consume them before the next block: at most one block's
        content is held at once)."""
        if self._whole is not None:
            for kg, entries in self._whole.items():
                if key_groups is None or kg in key_groups:
                    yield kg, entries
            return
        assert self._index is not None and self._source is not None
        for b in self._index.blocks_for(key_groups):
            record = self._source.read(b.offset, b.length)
            yield b.key_group, iter_block(record, b, key=self.key,
                                          max_block_bytes=self._max_block_bytes)
            del record


# --------------------------------------------------------------------------- the facade


@runtime_checkable
class StateTables(Protocol):
    """Operations a keyed backend uses; implemented by the heap and the LMDB table."""

    @property
    def key_groups(self) -> KeyGroupRange: ...

    def get(self, state_id: int, key_group: int, key: Any, namespace: Any) -> Any: ...

    def put(self, state_id: int, key_group: int, key: Any, namespace: Any,
            value: Any) -> None: ...

    def remove(self, state_id: int, key_group: int, key: Any, namespace: Any) -> bool: ...

    def contains(self, state_id: int, key_group: int, key: Any, namespace: Any) -> bool: ...

    def entries(self, state_id: int, key_group: int) -> Iterator[tuple[Any, Any, Any]]: ...

    def clear_state(self, state_id: int) -> None: ...

    def write_batch(self) -> contextlib.AbstractContextManager[Any]: ...

    def snapshot(self) -> TablesSnapshot: ...

    def load_snapshot(self, reader: SnapshotReader, decode: DecodeFn | None = None,
                      key_groups: KeyGroupRange | None = None) -> int: ...

    def stats(self) -> dict[str, int]: ...

    def count_state(self, state_id: int) -> int: ...

    def fixed_records(self) -> int: ...

    def close(self) -> None: ...


class HeapStateTables:
    """All states of one backend on the heap: state id -> :class:`CopyOnWriteStateTable`.

    Keys, namespaces and states are Python objects (hashable keys and namespaces). Concurrency:
    one writer thread for every operation and ``snapshot()``; a snapshot's ``write`` may run on
    another thread while the writer continues (see :mod:`materializer.cow_map`).

    Args:
        key_groups: the backend's key-group range.
        copier: state copier for every table (``None``: ``copy.deepcopy``; immutables never copy).
        initial_capacity: bucket count of each key group's map when created.
    """

    def __init__(self, key_groups: KeyGroupRange, copier: Callable[[Any], Any] | None = None, *,
                 initial_capacity: int = DEFAULT_CAPACITY) -> None:
        self._key_groups = key_groups
        self._copier = copier
        self._initial_capacity = initial_capacity
        self._tables: dict[int, CopyOnWriteStateTable[Any, Any, Any]] = {}
        self._closed = False

    @property
    def key_groups(self) -> KeyGroupRange:
        return self._key_groups

    def table(self, state_id: int) -> CopyOnWriteStateTable[Any, Any, Any]:
        """The table of ``state_id`` (created empty on first use)."""
        t = self._tables.get(state_id)
        if t is None:
            if self._closed:
                raise ClosedError("HeapStateTables", hint="create new tables")
            t = self._tables[check_state_id(state_id)] = CopyOnWriteStateTable(
                self._key_groups, self._copier, initial_capacity=self._initial_capacity)
        return t

    def state_ids(self) -> list[int]:
        """Ids of the states that have a table, ascending."""
        return sorted(self._tables)

    def get(self, state_id: int, key_group: int, key: Any, namespace: Any) -> Any:
        return self.table(state_id).get(key, key_group, namespace)

    def put(self, state_id: int, key_group: int, key: Any, namespace: Any, value: Any) -> None:
        self.table(state_id).put(key, key_group, namespace, value)

    def remove(self, state_id: int, key_group: int, key: Any, namespace: Any) -> bool:
        return self.table(state_id).remove(key, key_group, namespace)

    def contains(self, state_id: int, key_group: int, key: Any, namespace: Any) -> bool:
        return self.table(state_id).contains_key(key, key_group, namespace)

    def entries(self, state_id: int, key_group: int) -> Iterator[tuple[Any, Any, Any]]:
        """``(key, namespace, state)`` of one state in one key group, as of this call."""
        return self.table(state_id).entries(key_group)

    def clear_state(self, state_id: int) -> None:
        """Drop every entry of ``state_id`` (running snapshots keep their contents)."""
        self._tables.pop(check_state_id(state_id), None)

    def write_batch(self) -> contextlib.AbstractContextManager[None]:
        """No-op on the heap (writes are immediate); present so backends batch uniformly."""
        return contextlib.nullcontext()

    def snapshot(self) -> HeapTablesSnapshot:
        """Snapshot every state (call on the writer thread)."""
        if self._closed:
            raise ClosedError("HeapStateTables", hint="create new tables")
        return HeapTablesSnapshot(self._key_groups,
                                  {sid: t.snapshot() for sid, t in sorted(self._tables.items())})

    def load_snapshot(self, reader: SnapshotReader, decode: DecodeFn | None = None,
                      key_groups: KeyGroupRange | None = None) -> int:
        """Put the entries of a snapshot object's key groups into these tables.

        Reads only the key groups in ``key_groups ∩ self.key_groups`` (default: all of ours).

        Args:
            reader: the snapshot object.
            decode: turns stored bytes into ``(key, namespace, state)``; ``None`` keeps bytes.
            key_groups: restrict further (e.g. rescaling).

        Returns:
            entries loaded.
        """
        wanted = self._key_groups if key_groups is None else \
            self._key_groups.intersection(key_groups)
        count = 0
        for kg, entries in reader.read(wanted):
            for sid, k, ns, v in entries:
                if decode is not None:
                    key, namespace, state = decode(sid, k, ns, v)
                    self.table(sid).put(key, kg, namespace, state)
                else:
                    self.table(sid).put(k, kg, ns, v)
                count += 1
        return count

    def count_state(self, state_id: int) -> int:
        """Entries of one state (O(1))."""
        t = self._tables.get(state_id)
        return len(t) if t is not None else 0

    def fixed_records(self) -> int:
        """Records besides the states' entries: none on the heap."""
        return 0

    def stats(self) -> dict[str, int]:
        """Figures for progress reports: ``entries`` over all states, ``disk_bytes`` 0 (the heap
        has no file) and ``memory_bytes``, an estimate (:func:`estimate_table_bytes`: a sample
        of each state's entries, so its cost does not grow with the state)."""
        return {"entries": sum(len(t) for t in self._tables.values()), "disk_bytes": 0,
                "memory_bytes": sum(estimate_table_bytes(t) for t in self._tables.values())}

    def close(self) -> None:
        """Drop all tables. Idempotent."""
        self._closed = True
        self._tables.clear()


#: Entries of each state sampled for the heap's memory estimate.
MEMORY_SAMPLE = 32
#: Objects measured per sampled entry at most (a huge state is measured in part).
_MAX_OBJECTS_PER_ENTRY = 2000
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), memoryview)


def estimate_table_bytes(table: CopyOnWriteStateTable[Any, Any, Any]) -> int:
    """Estimated bytes of one heap table: its maps' structure (bucket arrays, entry objects)
    plus its entry count times the mean deep size of a sample of :data:`MEMORY_SAMPLE`
    entries' keys, namespaces and states. An object reached from more than one sampled entry
    (an interned namespace, a cached small int, a shared default) is taken as shared and not
    counted per entry. Like Spark's ``SizeEstimator``: sampled, so O(sample), not O(state)."""
    n = len(table)
    structure = table.structure_bytes()
    sample = table.sample(MEMORY_SAMPLE) if n else []
    if not sample:
        return structure
    owners: dict[int, int] = {}  # object id -> the sampled entry that reached it (-1: several)
    sizes: dict[int, int] = {}
    for i, entry in enumerate(sample):
        for obj in _reachable(entry):
            oid = id(obj)
            prev = owners.get(oid)
            owners[oid] = i if prev is None or prev == i else -1
            sizes[oid] = sys.getsizeof(obj)
    own = sum(sizes[oid] for oid, who in owners.items() if who >= 0)
    return structure + round(own / len(sample) * n)


def _reachable(entry: tuple[Any, Any, Any]) -> Iterator[Any]:
    """The objects a ``(key, namespace, state)`` holds, each once: containers, their items,
    instances' attribute dicts and slots (not classes or modules); at most
    :data:`_MAX_OBJECTS_PER_ENTRY`."""
    seen: set[int] = set()
    stack: list[Any] = list(entry)
    while stack and len(seen) < _MAX_OBJECTS_PER_ENTRY:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        yield obj
        if isinstance(obj, _LEAVES):
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            stack.extend(_attributes(obj))


def _attributes(obj: Any) -> list[Any]:
    """An instance's ``__dict__`` and slot values."""
    out: list[Any] = []
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        out.append(d)
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                with contextlib.suppress(AttributeError):
                    out.append(getattr(obj, name))
    return out


class HeapTablesSnapshot(TablesSnapshot):
    """Snapshot of :class:`HeapStateTables`: one table snapshot per state.

    During :meth:`write`, each key group's map snapshots are released as soon as its block is
    encoded, so the live maps stop copying for that key group (Flink's write-out order).
    """

    def __init__(self, key_groups: KeyGroupRange,
                 snaps: dict[int, CopyOnWriteStateTableSnapshot[Any, Any, Any]]) -> None:
        super().__init__(key_groups)
        self._snaps = snaps

    def __len__(self) -> int:
        return sum(len(s) for s in self._snaps.values())

    def _blocks(self, encode: EncodeFn | None) -> Iterator[tuple[int, Iterable[SnapshotEntry]]]:
        for kg in self._key_groups:
            per_state = [(sid, s) for sid, s in self._snaps.items() if s.has_key_group(kg)]
            if per_state:
                yield kg, _encoded(per_state, kg, encode)

    def _after_key_group(self, key_group: int) -> None:
        for s in self._snaps.values():
            s.release_key_group(key_group)

    def release(self) -> None:
        for s in self._snaps.values():
            s.release()


def _encoded(per_state: list[tuple[int, CopyOnWriteStateTableSnapshot[Any, Any, Any]]],
             kg: int, encode: EncodeFn | None) -> Iterator[SnapshotEntry]:
    for sid, s in per_state:
        if encode is None:
            for k, ns, v in s.entries(kg):
                yield sid, k, ns, v
        else:
            for k, ns, v in s.entries(kg):
                kb, nb, vb = encode(sid, k, ns, v)
                yield sid, kb, nb, vb

