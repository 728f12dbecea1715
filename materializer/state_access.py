"""``StateTableAccess``: the write path of a keyed backend — the current key and namespace, the
state table's slot under them, and the change record of every write.

Theory of operation
-------------------
- **Cursor.** ``set_current_key`` encodes the key once (the key codec), checks that its key group
  is this backend's, and keeps the key in the forms the table and the log need: the heap table
  holds objects, LMDB the encoded bytes; the log always holds ``encode_key_ns(key, namespace)``.
- **Double write.** A state's write updates the table (:meth:`StateTableAccess.write_state`)
  and appends one change record (:meth:`StateTableAccess.log_change`) in the key's key group;
  before a state's first change since the last cut its metadata record goes to key group -1
  (:attr:`~materializer.state_registry.StateRegistry.logged`).
- **Changed entries.** Every logged change also notes its entry for the next delta snapshot
  (:class:`~materializer.snapshot_writers.SnapshotWriters` takes them at a materialization's
  cut, :meth:`take_changes`); past ``max_delta_entries`` they are forgotten and the next
  materialization is a full one.
- **Raw states** (internal indexes, :mod:`materializer.timers`, :mod:`materializer.ttl`):
  entries at an explicit key group with raw key, namespace and value bytes; logged, snapshotted,
  restored and rescaled like every state, but no codec touches them.
- **Attention.** The materialization manager's triggers only raise a flag (:meth:`wake`); every
  access runs the pending work first (:meth:`attend`), on the owner thread.

It implements :class:`~materializer.states.StateAccess` (the state objects hold it directly, not
the backend, so a state's read or write costs no extra call) and
:class:`~materializer.ttl.TtlAccess`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from dstl.errors import (
    ClosedError,
    CorruptObjectError,
    DstlError,
    KeyGroupError,
    UsageError,
    located,
)
from dstl.keygroups import META_KEY_GROUP, KeyGroupRange, key_group_for
from dstl.writer import ChangelogWriter
from materializer.changes import CLEAR, OP_SID, SET, SET_INTERNAL, encode_key_ns, encode_metadata
from materializer.codecs import Codec, SafeCodec, decode_hashable
from materializer.state_registry import Registration, StateRegistry
from materializer.states import StateShape

__all__ = ["ChangedEntries", "ManagerHooks", "NamespaceCodec", "StateTableAccess", "TableSide"]

_pack_op_sid = OP_SID.pack

#: (key group, state id, key bytes, namespace bytes) -> the table's key and namespace
ChangedEntries = dict[tuple[int, int, bytes, bytes], tuple[Any, Any]]


class ManagerHooks(Protocol):
    """What the write path needs of the materialization manager."""

    def note_log(self, nbytes: int) -> None: ...

    def attend(self) -> None: ...


class NamespaceCodec:
    """Namespaces: ``None`` (the default namespace) is ``b""``; others use the safe codec (and
    must decode to something hashable: a namespace is a table key)."""

    name = "safe-ns"

    def __init__(self, max_decoded_bytes: int) -> None:
        self._safe = SafeCodec(max_decoded_bytes)

    def encode(self, ns: Any) -> bytes:
        return b"" if ns is None else self._safe.encode(ns)

    def decode(self, data: bytes) -> Any:
        return None if not data else decode_hashable(self._safe, data, "namespace")


class TableSide(Protocol):
    """What every job of a backend sees of its table side: the operator, its key groups, the
    table and its kind, and the codecs. The jobs' own Protocols extend it
    (``RestoreTable``, ``SnapshotTable``, ``RewriteTarget``); :class:`StateTableAccess`
    implements them all."""

    operator_id: str
    key_groups: KeyGroupRange
    table_kind: str
    tables: Any

    @property
    def key_codec(self) -> Codec: ...

    @property
    def namespace_codec(self) -> NamespaceCodec: ...


class StateTableAccess:
    """The table and the log under the current key and namespace (see the module docstring).

    Args:
        operator_id, key_groups, max_parallelism, table_kind: the backend's.
        tables: the state table (heap or LMDB); replaced by the backend's ``replace_table``.
        writer: the backend's changelog writer.
        registry: the backend's states.
        key_codec, ns_codec: how keys and namespaces are encoded.
        track_changes: remember changed entries for delta snapshots.
        max_changes: more changed entries than this: forget them (the next one is full).
        origin: names where the table's values came from (in the error of one that does not
            decode).
    """

    def __init__(self, operator_id: str, key_groups: KeyGroupRange, max_parallelism: int,
                 table_kind: str, tables: Any, writer: ChangelogWriter, registry: StateRegistry,
                 key_codec: Codec, ns_codec: NamespaceCodec, *, track_changes: bool,
                 max_changes: int, origin: Callable[[], str]) -> None:
        self.operator_id = operator_id
        self.key_groups = key_groups
        self.max_parallelism = max_parallelism
        self.table_kind = table_kind
        self.tables = tables
        self._heap = table_kind == "heap"
        self._writer = writer
        self._registry = registry
        self._by_id = registry.by_id
        self._raw = registry.raw
        self._meta_logged = registry.logged
        self._key_codec = key_codec
        self._ns_codec = ns_codec
        self._origin = origin
        self._changes: ChangedEntries | None = {} if track_changes else None
        self._max_changes = max_changes
        self._attention = False
        self._hooks: ManagerHooks | None = None
        self._note_log: Callable[[int], None] = lambda _n: None
        self.closed = False
        self._reset_cursor()

    def attach(self, hooks: ManagerHooks) -> None:
        """Connect the materialization manager (built after this write path)."""
        self._hooks = hooks
        self._note_log = hooks.note_log

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

    # ------------------------------------------------------------------ attention

    def wake(self) -> None:
        """The manager wants the owner thread (any thread may call it)."""
        self._attention = True

    def attend(self) -> None:
        """Run the manager's pending work (owner thread)."""
        self._attention = False
        if self._hooks is not None:
            self._hooks.attend()

    def check_open(self) -> None:
        if self.closed:
            raise ClosedError(f"backend {self.operator_id!r}")

    # ------------------------------------------------------------------ key / namespace

    def set_current_key(self, key: Any) -> None:
        """Set the key that state calls refer to.

        Raises:
            KeyGroupError: the key's key group is not owned by this backend.
            UsageError: the key codec cannot encode the key.
        """
        if self._attention:
            self.attend()
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
        if self._kg < 0:
            self.before_read()
        return bytes(self._key_b)

    @property
    def current_key_group(self) -> int:
        if self._kg < 0:
            self.before_read()
        return self._kg

    def set_current_namespace(self, namespace: Any) -> None:
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

    @property
    def key_codec(self) -> Codec:
        return self._key_codec

    @property
    def namespace_codec(self) -> NamespaceCodec:
        return self._ns_codec

    # ------------------------------------------------------------------ StateAccess

    def before_read(self) -> None:
        """Run pending work; raise ``UsageError`` when no current key is set."""
        if self._attention:
            self.attend()
        if self._kg < 0:
            raise UsageError(f"backend {self.operator_id!r}: set_current_key() first")

    def read_state(self, sid: int, shape: StateShape) -> Any:
        """The current key and namespace's value of state ``sid`` (decoded), or ``None``."""
        if self._kg < 0:
            self.before_read()
        v = self.tables.get(sid, self._kg, self._tk, self._tn)
        if v is None or self._heap:
            return v
        try:
            return shape.from_bytes(v)
        except CorruptObjectError as exc:
            raise self.stored_value_error(exc, sid, f"key {self._key!r:.80}, key group "
                                                    f"{self._kg}") from exc

    def stored_value_error(self, exc: CorruptObjectError, sid: int, where: str) -> DstlError:
        """A value of the LMDB table that does not decode (the table holds restored values as
        stored, undecoded), named by the table and the objects its state came from."""
        return located(exc, f"{self.tables.path} (LMDB table{self._origin()})", 0,
                       f"value of state {self._by_id[sid].meta['name']!r}, {where}")

    def read_state_raw(self, sid: int) -> Any:
        """The table's stored form (LMDB: bytes) without decoding."""
        if self._kg < 0:
            self.before_read()
        return self.tables.get(sid, self._kg, self._tk, self._tn)

    def before_mutation(self) -> None:
        """Before an in-place mutation of a live heap object: honour flags like a write."""
        if self._attention:
            self.attend()

    def write_state(self, sid: int, value: Any) -> None:
        """Store ``value`` (the table's stored form) for the current key and namespace."""
        if self._attention:
            self.attend()
        if self._kg < 0:
            self.before_read()
        self.tables.put(sid, self._kg, self._tk, self._tn, value)

    def write_state_object(self, sid: int, shape: StateShape, obj: Any) -> None:
        """Store the heap object ``obj`` (encoded with ``shape`` for LMDB)."""
        self.write_state(sid, obj if self._heap else shape.to_bytes(obj))

    def remove_state(self, sid: int) -> None:
        """Remove the current key and namespace's value of state ``sid``."""
        if self._attention:
            self.attend()
        if self._kg < 0:
            self.before_read()
        self.tables.remove(sid, self._kg, self._tk, self._tn)

    def log_change(self, op: int, sid: int, payload: bytes) -> None:
        """Append one change record of the current key and namespace to the log."""
        if sid not in self._meta_logged:
            self._log_metadata(sid)
        data = _pack_op_sid(op, sid) + self._kn + payload
        self._writer.append(self._kg, data)
        self._note_log(len(data))
        changes = self._changes
        if changes is not None:  # inline: the hot path of every write (_touch's job)
            changes[(self._kg, sid, self._key_b, self._ns_b)] = (self._tk, self._tn)
            if len(changes) > self._max_changes:
                self._changes = None

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

    # ------------------------------------------------------------------ the log, by bytes

    def _log_metadata(self, sid: int) -> None:
        self._writer.append(META_KEY_GROUP, encode_metadata(sid, self._by_id[sid].meta))
        self._meta_logged.add(sid)

    def log_raw(self, op: int, sid: int, key_group: int, key: bytes, namespace: bytes,
                payload: bytes, table_key: Any = None, table_ns: Any = None) -> None:
        """Log a change given by its bytes; ``table_key``/``table_ns``: the table's key and
        namespace when they are not those bytes (a heap state's objects)."""
        if sid not in self._meta_logged:
            self._log_metadata(sid)
        data = _pack_op_sid(op, sid) + encode_key_ns(key, namespace) + payload
        self._writer.append(key_group, data)
        self._note_log(len(data))
        if self._changes is not None:
            self._touch(key_group, sid, bytes(key), bytes(namespace),
                        key if table_key is None else table_key,
                        namespace if table_ns is None else table_ns)

    def _touch(self, kg: int, sid: int, kb: bytes, nb: bytes, tk: Any, tn: Any) -> None:
        """Remember a changed entry for the next delta (``log_change``, the hot path, does the
        same inline)."""
        changes = self._changes
        if changes is None:
            return
        changes[(kg, sid, kb, nb)] = (tk, tn)
        if len(changes) > self._max_changes:
            self._changes = None  # the next materialization is a full one

    def entry_bytes(self, sid: int, key: Any, ns: Any) -> tuple[bytes, bytes]:
        """A table entry's key and namespace as the log holds them (the heap table holds
        objects; LMDB and raw states the bytes)."""
        if self._heap and sid not in self._raw:
            return self._key_codec.encode(key), self._ns_codec.encode(ns)
        return bytes(key), bytes(ns)

    # ------------------------------------------------------------------ changed entries

    def take_changes(self) -> ChangedEntries | None:
        """The entries changed since the previous call (``None``: not known); later changes
        are noted for the next one."""
        changes, self._changes = self._changes, {}
        return changes

    def lose_changes(self) -> None:
        """The taken changes are in no snapshot piece: the next materialization is full."""
        self._changes = None

    # ------------------------------------------------------------------ registrations

    def registered_state(self, state_id: int) -> Registration | None:
        """The registration of this backend's ``state_id`` (its shape and metadata), if any."""
        return self._by_id.get(state_id)

    def is_raw_state(self, state_id: int) -> bool:
        return state_id in self._raw

    def register_raw_state(self, name: str) -> int:
        """Register (or look up) the raw state ``name``; returns its state id."""
        self.check_open()
        return self._registry.register_raw(name)

    # ------------------------------------------------------------------ raw states

    def _raw_check(self, sid: int, key_group: int) -> None:
        self.check_open()
        if self._attention:
            self.attend()
        if sid not in self._raw:
            raise UsageError(f"state id {sid} of backend {self.operator_id!r} is not a raw state")
        if type(key_group) is not int or key_group not in self.key_groups:
            raise KeyGroupError(key_group, f"backend {self.operator_id!r}", self.key_groups,
                                "a raw entry lives in a key group of its backend")

    def raw_put(self, sid: int, key_group: int, key: bytes, namespace: bytes,
                value: bytes) -> None:
        """Store and log a raw entry."""
        self._raw_check(sid, key_group)
        self.tables.put(sid, key_group, key, namespace, value)
        self.log_raw(SET, sid, key_group, key, namespace, value)

    def raw_remove(self, sid: int, key_group: int, key: bytes, namespace: bytes) -> bool:
        """Remove a raw entry (logged when it existed); whether it existed."""
        self._raw_check(sid, key_group)
        if not self.tables.remove(sid, key_group, key, namespace):
            return False
        self.log_raw(CLEAR, sid, key_group, key, namespace, b"")
        return True

    def raw_get(self, sid: int, key_group: int, key: bytes, namespace: bytes) -> bytes | None:
        """A raw entry's value, or ``None``."""
        self._raw_check(sid, key_group)
        v = self.tables.get(sid, key_group, key, namespace)
        return None if v is None else bytes(v)

    def raw_entries(self, sid: int, key_group: int) -> Iterator[tuple[bytes, bytes, bytes]]:
        """``(key, namespace, value)`` of a raw state in one key group (LMDB: sorted by key
        bytes; heap: in no particular order)."""
        self._raw_check(sid, key_group)
        return iter(list(self.tables.entries(sid, key_group)))

    # ------------------------------------------------------------------ whole states

    def delete_entries(self, reg: Registration) -> int:
        """Remove and log (``CLEAR``) every entry of the state ``reg``; returns how many."""
        if self._attention:
            self.attend()
        sid = reg.state_id
        removed = 0
        for kg in range(self.key_groups.start, self.key_groups.end + 1):
            for key, ns, _ in list(self.tables.entries(sid, kg)):
                kb, nb = self.entry_bytes(sid, key, ns)
                self.tables.remove(sid, kg, key, ns)
                self.log_raw(CLEAR, sid, kg, kb, nb, b"", key, ns)
                removed += 1
        return removed

