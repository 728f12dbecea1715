"""State TTL: values, list elements, map entries and reducing/aggregating states' folded values
that expire (Spark's ``TTLConfig``; Flink's ``StateTtlConfig`` with ``OnCreateAndWrite`` and
``NeverReturnExpired``).

Theory of operation
-------------------
A state declared with ``ttl_s`` (a descriptor argument, :func:`check_ttl_s`) stores every value —
each list element, each map value — with its expiry: the :class:`~materializer.codecs.TtlCodec`
wraps the state's codec, so the table (heap: ``(expiry_ms, value)`` pairs; LMDB, snapshots and
the log: a 9-byte header before the value's bytes) and the state's metadata (codec name
``ttl:<inner>``) carry it, and restores, rescales, file snapshots and the reader need nothing
else. As in Spark, every write sets the written value's expiry to *now + ttl* (an update
refreshes it; a list append gives the new elements theirs and leaves the others as they are).
A reducing or aggregating state stores its folded value (the result, the accumulator) as one
such pair, like a value state: each ``add`` refreshes it, and an ``add`` to an expired value
folds from nothing, as if the state were empty (:class:`TtlReducingState`,
:class:`TtlAggregatingState`).

*Now* is the backend's TTL clock (:meth:`TtlService.set_time`): under Spark the batch's
processing time, fixed per batch and kept by a re-run (``dstl.spark.operator``); without it the
wall clock. A value whose expiry is at or before now is **invisible at once**: the TTL states
(:class:`TtlValueState`, :class:`TtlListState`, :class:`TtlMapState`, and the two folding
states) filter every read — ``get``, ``exists``, iteration, ``keys``, ``values``, ``contains``.

**Purge.** Expired values are removed by :meth:`TtlService.purge`, which the Spark task calls at
the start of every batch (before initial state, timers and input), so an expired value is gone
from the table by the end of the first batch whose processing time reaches its expiry. Every
removal is an ordinary change record (``CLEAR`` of a value or a folded value, ``SET_INTERNAL``
of a list's survivors, ``REMOVE_ELEMENT`` of a map entry), so a restore from the log, from a
snapshot, or a rescale sees exactly what the uninterrupted run sees.

The purge never scans the states. ``$ttl_index`` is a raw state (like the timer index,
:mod:`materializer.timers`) in each key's key group: entry key = ``expiry (8 order-preserving
bytes) | state id (u16)``, namespace = the key's and namespace's bytes, value = the key and
namespace objects (safe codec). The index keeps one invariant: every (state, key, namespace)
holding TTL values has an entry at or before its earliest expiry. A write adds an entry only
when its expiry is earlier than an expiry already stored there (one read the write does
anyway: the old value, a list's first element, the entry being replaced) or the slot was
empty — a refresh of a value adds nothing. The purge takes the due entries (LMDB: one cursor
seek per key group; heap: a binary heap built on first use, as for timers), removes each, purges
its slot and re-indexes the slot at its earliest surviving expiry. An entry left by a value
that was cleared or refreshed finds nothing to purge when it comes due.

Changing ``ttl_s`` of a state across a restart is allowed (as in Spark): later writes use the
new TTL, stored expiries stay. A state's TTL-ness cannot change: a state written without TTL
cannot be opened with one, nor the reverse (:class:`~dstl.errors.StateError` naming the state:
the stored values have no expiry, or have one; its metadata, in every log and snapshot, names
the codec) — use a new state name.

The clock is the caller's: a backend used without Spark whose clock is set back sees values
that expired at the later time and were not purged yet again. The Spark operator never sets it
back (a batch's processing time is at least its base checkpoint's).
"""

from __future__ import annotations

import heapq
import math
import struct
import time
from collections.abc import Iterable, Iterator
from typing import Any, Final, Protocol

from dstl.errors import UsageError
from dstl.keygroups import KeyGroupRange
from materializer.changes import (
    ADD,
    ADD_ELEMENT,
    ADD_OR_UPDATE_ELEMENT,
    CLEAR,
    REMOVE_ELEMENT,
    SET,
    SET_INTERNAL,
    append_framed,
    encode_key_ns,
    encode_map_entry,
    frame,
    iter_framed,
)
from materializer.codecs import Codec, SafeCodec, TtlCodec, expiry_of
from materializer.states import (
    _IMMUTABLE,
    MAX_TTL_S,
    AggregatingState,
    KeyedState,
    ListState,
    MapState,
    ReducingState,
    RegisteredState,
    StateAccess,
    StateDescriptor,
    StateShape,
    ValueState,
    check_ttl_s,
    copy_out,
)

__all__ = [
    "MAX_TTL_S",
    "TTL_INDEX_STATE",
    "TTL_STATE_CLASSES",
    "TtlAccess",
    "TtlAggregatingState",
    "TtlListState",
    "TtlMapState",
    "TtlReducingState",
    "TtlService",
    "TtlValueState",
    "check_ttl_s",
    "new_ttl_state",
    "ttl_ms_of",
]

#: The raw state of the expiry index.
TTL_INDEX_STATE: Final = "$ttl_index"
_MAX_MS: Final = (1 << 63) - 1
_BIAS: Final = 1 << 63
_IDX: Final = struct.Struct(">QH")  # biased expiry, state id


def ttl_ms_of(ttl_s: float) -> int:
    """Whole milliseconds of a checked TTL (at least 1)."""
    return max(1, math.ceil(ttl_s * 1000))


def _expiry(now_ms: int, ttl_ms: int) -> int:
    return min(now_ms + ttl_ms, _MAX_MS)


class TtlAccess(StateAccess, Protocol):
    """What :class:`TtlService` needs of its backend beyond a state's :class:`StateAccess`: the
    current key and namespace (set, read, encoded), the raw state of the expiry index, the
    registrations and the table. Implemented by the backend's write path,
    :class:`~materializer.state_access.StateTableAccess`."""

    key_groups: KeyGroupRange

    @property
    def has_current_key(self) -> bool: ...

    @property
    def current_key_group(self) -> int: ...

    @property
    def current_key_bytes(self) -> bytes: ...

    @property
    def current_namespace(self) -> Any: ...

    @property
    def current_namespace_bytes(self) -> bytes: ...

    @property
    def key_codec(self) -> Codec: ...

    @property
    def namespace_codec(self) -> Any: ...

    @property
    def tables(self) -> Any: ...

    def set_current_key(self, key: Any) -> None: ...

    def set_current_namespace(self, namespace: Any) -> None: ...

    def register_raw_state(self, name: str) -> int: ...

    def registered_state(self, state_id: int) -> RegisteredState | None: ...

    def raw_put(self, sid: int, key_group: int, key: bytes, namespace: bytes,
                value: bytes) -> None: ...

    def raw_remove(self, sid: int, key_group: int, key: bytes, namespace: bytes) -> bool: ...

    def raw_get(self, sid: int, key_group: int, key: bytes, namespace: bytes) -> bytes | None: ...

    def raw_entries(self, sid: int, key_group: int) -> Iterator[tuple[bytes, bytes, bytes]]: ...


class TtlService:
    """The TTL clock, the expiry index and the purge of one backend (see the module
    docstring). Created by the backend with its first TTL state, or when it restored an
    index."""

    def __init__(self, backend: TtlAccess) -> None:
        self._b = backend
        self._sid: int = backend.register_raw_state(TTL_INDEX_STATE)
        self._lmdb = backend.table_kind == "lmdb"
        self._now: int | None = None
        self._safe = SafeCodec()
        self._heap: list[tuple[int, int, bytes, int]] | None = None  # heap table, first purge

    # ------------------------------------------------------------------ the clock

    def set_time(self, now_ms: int | None) -> None:
        """Fix the TTL clock at ``now_ms`` (epoch ms; ``None``: the wall clock at each call)."""
        if now_ms is not None and (type(now_ms) is not int or not 0 <= now_ms <= _MAX_MS):
            raise UsageError(f"TTL time {now_ms!r} must be an int of epoch milliseconds >= 0")
        self._now = now_ms

    def now(self) -> int:
        return self._now if self._now is not None else int(time.time() * 1000)

    # ------------------------------------------------------------------ the index

    def note(self, sid: int, expiry_ms: int, known_ms: int | None) -> None:
        """The current key and namespace of state ``sid`` got a value expiring at
        ``expiry_ms``; ``known_ms``: an expiry stored there before (None: the slot was empty)."""
        if known_ms is None or expiry_ms < known_ms:
            self._index(sid, expiry_ms)

    def _index(self, sid: int, expiry_ms: int) -> None:
        b = self._b
        kg = b.current_key_group
        ns_raw = encode_key_ns(b.current_key_bytes, b.current_namespace_bytes)
        try:
            who = self._safe.encode((b.get_current_key(), b.current_namespace))
        except UsageError:
            who = b""  # a key the safe codec cannot hold: decoded by the key codec when due
        b.raw_put(self._sid, kg, _IDX.pack(expiry_ms + _BIAS, sid), ns_raw, who)
        if self._heap is not None:
            heapq.heappush(self._heap, (expiry_ms, sid, ns_raw, kg))

    def _due(self, now_ms: int) -> list[tuple[int, int, bytes, int, bytes]]:
        """``(expiry, state id, key+namespace bytes, key group, key objects)`` of the due
        index entries, in expiry order."""
        b = self._b
        out: list[tuple[int, int, bytes, int, bytes]] = []
        if self._lmdb:
            bound = _IDX.pack(now_ms + _BIAS, 0xFFFF)
            for kg in b.key_groups:
                for k, ns_raw, who in b.tables.entries_up_to(self._sid, kg, _IDX.size, bound):
                    biased, sid = _IDX.unpack(bytes(k))
                    out.append((biased - _BIAS, sid, bytes(ns_raw), kg, bytes(who)))
            out.sort()
            return out
        if self._heap is None:
            self._heap = []
            for kg in b.key_groups:
                for k, ns_raw, _ in b.raw_entries(self._sid, kg):
                    biased, sid = _IDX.unpack(k)
                    self._heap.append((biased - _BIAS, sid, ns_raw, kg))
            heapq.heapify(self._heap)
        seen = set()
        while self._heap and self._heap[0][0] <= now_ms:
            entry = heapq.heappop(self._heap)
            if entry in seen:
                continue
            seen.add(entry)
            expiry, sid, ns_raw, kg = entry
            who = b.raw_get(self._sid, kg, _IDX.pack(expiry + _BIAS, sid), ns_raw)
            if who is not None:
                out.append((expiry, sid, ns_raw, kg, who))
        return out

    # ------------------------------------------------------------------ the purge

    def purge(self, now_ms: int | None = None) -> int:
        """Remove (logged) every value expired at ``now_ms`` (default: the TTL clock) that the
        index names; returns how many values (list elements, map entries) were removed. The
        backend's current key and namespace are restored afterwards."""
        now = self.now() if now_ms is None else now_ms
        due = self._due(now)
        if not due:
            return 0
        b = self._b
        saved = (b.get_current_key(), b.current_namespace) if b.has_current_key else None
        removed = 0
        try:
            for expiry, sid, ns_raw, kg, who in due:
                b.raw_remove(self._sid, kg, _IDX.pack(expiry + _BIAS, sid), ns_raw)
                reg = b.registered_state(sid)
                if reg is None or not isinstance(reg.shape.codec, TtlCodec):
                    continue  # a state that no longer has TTL values: nothing to purge
                self._set_slot(ns_raw, who)
                n, earliest = _purge_slot(b, sid, reg.shape, now)
                removed += n
                if earliest is not None:
                    self._index(sid, earliest)
        finally:
            if saved is not None:
                b.set_current_key(saved[0])
                b.set_current_namespace(saved[1])
        return removed

    def _set_slot(self, ns_raw: bytes, who: bytes) -> None:
        b = self._b
        if who:
            key, ns = self._safe.decode(who)
        else:
            (klen,) = struct.unpack_from(">I", ns_raw)
            key = b.key_codec.decode(ns_raw[4:4 + klen])
            ns = b.namespace_codec.decode(ns_raw[8 + klen:]) if len(ns_raw) > 8 + klen else None
        b.set_current_key(key)
        b.set_current_namespace(ns)


def _purge_slot(b: StateAccess, sid: int, shape: StateShape, now: int) -> tuple[int, int | None]:
    """Purge the current key and namespace of TTL state ``sid``: ``(values removed, earliest
    surviving expiry or None)``."""
    v = b.read_state(sid, shape)
    if v is None:
        return 0, None
    kind = shape.kind
    if kind == "list":
        keep = [p for p in v if p[0] > now]
        if len(keep) < len(v):
            if keep:
                enc = shape.codec.encode
                b.write_state_object(sid, shape, keep)
                b.log_change(SET_INTERNAL, sid, frame([enc(p) for p in keep]))
            else:
                b.remove_state(sid)
                b.log_change(CLEAR, sid, b"")
        return len(v) - len(keep), min((p[0] for p in keep), default=None)
    if kind == "map":
        gone = [k for k, p in v.items() if p[0] <= now]
        if gone:
            live = {k: p for k, p in v.items() if p[0] > now}
            if live:
                b.write_state_object(sid, shape, live)
            else:
                b.remove_state(sid)
            assert shape.key_codec is not None  # a map state's shape has one
            kenc = shape.key_codec.encode
            for k in gone:
                b.log_change(REMOVE_ELEMENT, sid, kenc(k))
            v = live
        return len(gone), min((p[0] for p in v.values()), default=None)
    if v[0] <= now:
        b.remove_state(sid)
        b.log_change(CLEAR, sid, b"")
        return 1, None
    return 0, v[0]


# --------------------------------------------------------------------------- the states


class _Ttl:
    """What the TTL states share: the service and the TTL in ms."""

    _b: StateAccess
    _sid: int
    _heap: bool

    def _init_ttl(self, service: TtlService, ttl_s: float) -> None:
        self._svc = service
        self._ttl_ms = ttl_ms_of(ttl_s)

    def _pair_alive(self) -> bool:
        """Whether a state stored as one ``(expiry, value)`` pair (a value state's, a folding
        state's) holds one that has not expired, read without decoding the value."""
        b = self._b
        b.before_read()
        raw = b.read_state_raw(self._sid)
        if raw is None:
            return False
        return (raw[0] if self._heap else expiry_of(raw)) > self._svc.now()

    def _stored(self, state: KeyedState, expiry: int, value: Any, encoded: bytes) -> Any:
        """What the heap keeps for a pair written as ``encoded``."""
        if type(value) in _IMMUTABLE:
            return (expiry, value)
        return state._shape.codec.decode(encoded)


def _first_expiry(raw_list: Any, heap: bool) -> int | None:
    """An expiry stored in a list (its first element's), or None when it is empty."""
    if not raw_list:
        return None
    if heap:
        return int(raw_list[0][0])
    first = next(iter_framed(raw_list), None)
    return None if first is None else expiry_of(first)


class TtlValueState(ValueState, _Ttl):
    """A value state whose value expires ``ttl_s`` after its last update."""

    def _alive(self) -> Any:
        b = self._b
        b.before_read()
        v = b.read_state(self._sid, self._shape)
        if v is None or v[0] <= self._svc.now():
            return None
        return copy_out(v[1]) if self._heap else v[1]

    def value(self) -> Any:
        return self._alive()

    def get(self) -> Any:
        return self._alive()

    def exists(self) -> bool:
        return self._pair_alive()

    def update(self, value: Any) -> None:
        if value is None:
            self.clear()
            return
        b = self._b
        b.before_mutation()
        expiry = _expiry(self._svc.now(), self._ttl_ms)
        old = b.read_state_raw(self._sid)
        known = None if old is None else (old[0] if self._heap else expiry_of(old))
        vb = self._codec.encode((expiry, value))
        b.write_state(self._sid, self._stored(self, expiry, value, vb) if self._heap else vb)
        b.log_change(SET, self._sid, vb)
        self._svc.note(self._sid, expiry, known)


class TtlListState(ListState, _Ttl):
    """A list state whose elements expire individually, ``ttl_s`` after each was written."""

    def _read(self) -> Any:
        b = self._b
        b.before_read()
        v = b.read_state(self._sid, self._shape)
        if v is None:
            return None
        now = self._svc.now()
        alive = [x for e, x in v if e > now]
        return (copy_out(alive) if self._heap else alive) or None

    def exists(self) -> bool:
        return self._read() is not None

    def add(self, value: Any) -> None:
        self.add_all([value])

    def add_all(self, values: Iterable[Any]) -> None:
        values = list(values)
        if not values:
            return
        b = self._b
        b.before_mutation()
        expiry = _expiry(self._svc.now(), self._ttl_ms)
        enc = [self._codec.encode((expiry, v)) for v in values]
        if self._heap:
            items = [self._stored(self, expiry, v, e) for v, e in zip(values, enc)]
            lst = self._live()
            known = _first_expiry(lst, True)
            if lst is None:
                b.write_state(self._sid, items)
            else:
                lst.extend(items)
        else:
            raw = b.read_state_raw(self._sid)
            known = _first_expiry(raw, False)
            b.write_state(self._sid, append_framed(raw, enc))
        if len(enc) == 1:
            b.log_change(ADD_ELEMENT, self._sid, enc[0])
        else:
            b.log_change(ADD, self._sid, frame(enc))
        self._svc.note(self._sid, expiry, known)

    def update(self, values: Iterable[Any]) -> None:
        values = list(values)
        if not values:
            self.clear()
            return
        b = self._b
        b.before_mutation()
        expiry = _expiry(self._svc.now(), self._ttl_ms)
        known = _first_expiry(b.read_state_raw(self._sid), self._heap)
        enc = [self._codec.encode((expiry, v)) for v in values]
        b.write_state_object(self._sid, self._shape,
                             [self._stored(self, expiry, v, e) for v, e in zip(values, enc)])
        b.log_change(SET_INTERNAL, self._sid, frame(enc))
        self._svc.note(self._sid, expiry, known)

    def merge_namespaces(self, target: Any, sources: Iterable[Any]) -> None:
        raise UsageError(f"list state {self.name!r} has a TTL; namespace merges of TTL states "
                         "are not supported (use a state without ttl_s)")


class TtlMapState(MapState, _Ttl):
    """A map state whose entries expire individually, ``ttl_s`` after each was written."""

    def _map(self) -> dict[Any, Any]:
        """The live entries' values (a new dict; callers copy out what they return)."""
        b = self._b
        b.before_read()
        d = self._live()
        if not d:
            return {}
        now = self._svc.now()
        return {k: p[1] for k, p in d.items() if p[0] > now}

    def exists(self) -> bool:
        return bool(self._map())

    def put(self, key: Any, value: Any) -> None:
        self._put({key: value})

    def put_all(self, entries: Any) -> None:
        if entries:
            self._put(dict(entries))

    def _put(self, entries: dict[Any, Any]) -> None:
        b = self._b
        b.before_mutation()
        expiry = _expiry(self._svc.now(), self._ttl_ms)
        kc = self._shape.key_codec
        assert kc is not None
        d = self._live()
        # any stored expiry is at or after the slot's earliest (the index invariant)
        known = next(iter(d.values()))[0] if d else None
        items: list[bytes] = []
        new = {}
        for k, v in entries.items():
            kb, vb = kc.encode(k), self._codec.encode((expiry, v))
            items.append(kb)
            items.append(vb)
            new[k] = self._stored(self, expiry, v, vb)
        if d is None:
            b.write_state_object(self._sid, self._shape, new)
        else:
            d.update(new)
            if not self._heap:
                b.write_state_object(self._sid, self._shape, d)
        if len(new) == 1:
            b.log_change(ADD_OR_UPDATE_ELEMENT, self._sid, encode_map_entry(items[0], items[1]))
        else:
            b.log_change(ADD, self._sid, frame(items))
        self._svc.note(self._sid, expiry, known)

    def merge_namespaces(self, target: Any, sources: Iterable[Any]) -> None:
        raise UsageError(f"map state {self.name!r} has a TTL; namespace merges of TTL states "
                         "are not supported (use a state without ttl_s)")


class _TtlFolding(_Ttl):
    """What the TTL reducing and aggregating states share: the folded value (the result, or
    the accumulator) is stored as one ``(expiry, value)`` pair, like a value state's, and every
    ``add`` refreshes it. An ``add`` to an expired value starts from nothing, as if the state
    were empty (it is invisible; the purge may not have removed it yet)."""

    _codec: Any

    def _folded(self, state: KeyedState) -> Any:
        """The live folded value (a copy on the heap), or None when none or expired."""
        b = self._b
        b.before_read()
        v = b.read_state(self._sid, state._shape)
        if v is None or v[0] <= self._svc.now():
            return None
        return copy_out(v[1]) if self._heap else v[1]

    def _fold(self, state: KeyedState, fold: Any) -> None:
        """Store ``fold(live value or None)`` with a new expiry (logged as the result, so a
        replay runs no user function)."""
        b = self._b
        b.before_mutation()
        now = self._svc.now()
        old = b.read_state(self._sid, state._shape)
        live = None if old is None or old[0] <= now else copy_out(old[1])
        new = fold(live)
        expiry = _expiry(now, self._ttl_ms)
        vb = self._codec.encode((expiry, new))
        b.write_state(self._sid, self._stored(state, expiry, new, vb) if self._heap else vb)
        b.log_change(SET_INTERNAL, self._sid, vb)
        self._svc.note(self._sid, expiry, None if old is None else int(old[0]))

    def exists(self) -> bool:
        return self._pair_alive()


class TtlReducingState(_TtlFolding, ReducingState):
    """A reducing state whose value expires ``ttl_s`` after its last ``add``."""

    def get(self) -> Any:
        return self._folded(self)

    def add(self, value: Any) -> None:
        self._fold(self, lambda cur: value if cur is None else self._fn(cur, value))

    def merge_namespaces(self, target: Any, sources: Iterable[Any]) -> None:
        raise UsageError(f"reducing state {self.name!r} has a TTL; namespace merges of TTL "
                         "states are not supported (use a state without ttl_s)")


class TtlAggregatingState(_TtlFolding, AggregatingState):
    """An aggregating state whose accumulator expires ``ttl_s`` after its last ``add``."""

    def get(self) -> Any:
        acc = self._folded(self)
        return None if acc is None else self._agg.get_result(acc)

    def add(self, value: Any) -> None:
        agg = self._agg
        self._fold(self, lambda cur: agg.add(value, agg.create_accumulator() if cur is None
                                             else cur))

    def merge_namespaces(self, target: Any, sources: Iterable[Any]) -> None:
        raise UsageError(f"aggregating state {self.name!r} has a TTL; namespace merges of TTL "
                         "states are not supported (use a state without ttl_s)")


#: The TTL state class of each kind.
TTL_STATE_CLASSES: Final[dict[str, type[KeyedState]]] = {
    "value": TtlValueState, "list": TtlListState, "map": TtlMapState,
    "reducing": TtlReducingState, "aggregating": TtlAggregatingState,
}


def new_ttl_state(backend: StateAccess, state_id: int, descriptor: StateDescriptor,
                  shape: StateShape, service: TtlService, ttl_s: float) -> KeyedState:
    """The TTL state of ``descriptor``'s kind, tied to ``service`` with ``ttl_s``."""
    state = TTL_STATE_CLASSES[descriptor.kind](backend, state_id, descriptor, shape)
    assert isinstance(state, _Ttl)
    state._init_ttl(service, ttl_s)
    return state
