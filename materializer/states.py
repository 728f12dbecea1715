"""State descriptors and the user-facing state objects (PyFlink's and Spark's method names).

Every mutation is a double write: the backend's state table first, then one change record in the
log (:mod:`materializer.changes`). Reads never log. Reducing and aggregating ``add`` log the whole
new accumulator, and namespace merges log their effects, so replay never runs user functions.

Values returned by reads are the table's own objects for immutable values and copies otherwise;
mutating a returned container does not change state (and is not logged) — write it back with
``update``/``put``.

The states reach their backend only through :class:`StateAccess`: the current key and namespace's
slot in the state table, and the log. :class:`~materializer.backend.ChangelogKeyedStateBackend`
implements it with public members; this module does not import the backend (the backend imports
the states), so the two have no import cycle.

Both APIs' names work on the same objects (docs/spark.md has the table): Spark's
``transformWithState`` names (``exists``, ``get``, ``put``, ``append_value``, ``append_list``,
``get_value``, ``contains_key``, ``update_value``, ``remove_key``) are thin methods over the PyFlink
ones, so each mutation is logged exactly once, by the PyFlink method. Where the two APIs mean
different things by one name, the call shape decides: ``MapState.iterator()`` yields entries that
are both PyFlink ``MapEntry`` objects and Spark's ``(key, value)`` pairs.

Representation per kind: on the heap a state is a Python object (value, ``list``, ``dict``); in
LMDB and in snapshots it is bytes: the codec's encoding for value/reducing/aggregating, a framed
list of encoded elements for lists, and framed (key, value) pairs for maps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from dstl.checks import check_callable, check_number, check_protocol, check_str
from dstl.errors import StateTypeError, UsageError
from materializer.changes import (
    ADD,
    ADD_ELEMENT,
    ADD_OR_UPDATE_ELEMENT,
    CLEAR,
    REMOVE_ELEMENT,
    SET,
    SET_INTERNAL,
    append_framed,
    encode_map_entry,
    frame,
    iter_framed,
    iter_pairs,
)
from materializer.codecs import TTL_CODEC_PREFIX, Codec, SafeCodec, check_codec, decode_hashable
from materializer.schema import compile_checker, normalize_schema, type_string

__all__ = [
    "STATE_CLASSES",
    "AggregateFunction",
    "AggregatingState",
    "AggregatingStateDescriptor",
    "MAX_TTL_S",
    "KeyedState",
    "ListState",
    "ListStateDescriptor",
    "MapEntry",
    "MapState",
    "MapStateDescriptor",
    "ReducingState",
    "ReducingStateDescriptor",
    "StateAccess",
    "StateDescriptor",
    "StateShape",
    "ValueState",
    "ValueStateDescriptor",
    "check_ttl_s",
]

_IMMUTABLE: Final = frozenset({type(None), bool, int, float, str, bytes})


def copy_out(value: Any) -> Any:
    """An independent copy of a plain-data value (immutables are returned as they are)."""
    t = type(value)
    if t in _IMMUTABLE:
        return value
    if t is list:
        return [copy_out(v) for v in value]
    if t is dict:
        return {k: copy_out(v) for k, v in value.items()}
    if t is tuple:
        return tuple(copy_out(v) for v in value)
    return copy.deepcopy(value)


class AggregateFunction(Protocol):
    """PyFlink's AggregateFunction shape."""

    def create_accumulator(self) -> Any: ...

    def add(self, value: Any, accumulator: Any) -> Any: ...

    def get_result(self, accumulator: Any) -> Any: ...

    def merge(self, a: Any, b: Any) -> Any: ...


#: Longest TTL (about 317 years): now + ttl stays far inside signed 64-bit milliseconds.
MAX_TTL_S: Final = 1e10


def check_ttl_s(value: object, owner: str) -> float:
    """``value`` as seconds of TTL: a finite number in ``(0, MAX_TTL_S]``.

    Raises:
        ConfigTypeError: not an int or float (a bool or a string, say).
        ConfigError: zero, negative, NaN, infinite or above :data:`MAX_TTL_S`.
    """
    return check_number(value, "ttl_s", owner, lo=0.0, hi=MAX_TTL_S, lo_open=True,
                        unit="seconds", fix="the state's time to live in seconds, e.g. "
                                            "ttl_s=3600; leave it out for no TTL")


#: Longest state name (state metadata carries it in every log and snapshot).
MAX_STATE_NAME_CHARS: Final = 255


@dataclass(frozen=True)
class StateDescriptor:
    """Base of all descriptors: a name, an optional value codec (default: the safe codec), an
    optional time to live ``ttl_s`` (seconds, keyword only; Spark's ``TTLConfig``:
    :mod:`materializer.ttl`) and an optional declared type ``schema`` of the values (keyword
    only; a Spark type name, DDL string, ``DataType`` or its JSON form: :mod:`materializer.schema`;
    kept in Spark's JSON form). A state without one takes any value its codec encodes.

    Raises:
        ConfigError: a bad name, codec or ttl_s (ConfigTypeError: a wrong type), at
            construction.
    """

    name: str
    serializer: Codec | None = None
    kind: str = field(default="", init=False)
    ttl_s: float | None = field(default=None, kw_only=True)
    schema: Any = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        """Every descriptor's arguments (subclasses add theirs)."""
        owner = type(self).__name__
        check_str(self.name, "name", owner, max_chars=MAX_STATE_NAME_CHARS,
                  fix="the state's name, unique within its backend")
        check_codec(self.serializer, "serializer", owner)
        if self.ttl_s is not None:
            check_ttl_s(self.ttl_s, owner)
        if self.schema is not None:
            object.__setattr__(self, "schema", normalize_schema(self.schema, owner))

    def codec(self) -> Codec:
        return self.serializer if self.serializer is not None else SafeCodec()


@dataclass(frozen=True)
class ValueStateDescriptor(StateDescriptor):
    kind: str = field(default="value", init=False)


@dataclass(frozen=True)
class ListStateDescriptor(StateDescriptor):
    kind: str = field(default="list", init=False)


@dataclass(frozen=True)
class MapStateDescriptor(StateDescriptor):
    """Map state; ``key_serializer`` encodes the map's keys (default: the safe codec)."""

    key_serializer: Codec | None = None
    kind: str = field(default="map", init=False)

    def _check(self) -> None:
        super()._check()
        check_codec(self.key_serializer, "key_serializer", type(self).__name__)

    def key_codec(self) -> Codec:
        return self.key_serializer if self.key_serializer is not None else SafeCodec()


@dataclass(frozen=True)
class ReducingStateDescriptor(StateDescriptor):
    reduce_fn: Callable[[Any, Any], Any] | None = None
    kind: str = field(default="reducing", init=False)

    def __init__(self, name: str, reduce_fn: Callable[[Any, Any], Any],
                 serializer: Codec | None = None, *, ttl_s: float | None = None,
                 schema: Any = None) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "serializer", serializer)
        object.__setattr__(self, "reduce_fn", reduce_fn)
        object.__setattr__(self, "ttl_s", ttl_s)
        object.__setattr__(self, "schema", schema)
        self._check()

    def _check(self) -> None:
        super()._check()
        check_callable(self.reduce_fn, "reduce_fn", type(self).__name__, args=2,
                       fix="reduce_fn(accumulated, new) returns the new value")


@dataclass(frozen=True)
class AggregatingStateDescriptor(StateDescriptor):
    agg: AggregateFunction | None = None
    kind: str = field(default="aggregating", init=False)

    def __init__(self, name: str, agg: AggregateFunction,
                 serializer: Codec | None = None, *, ttl_s: float | None = None,
                 schema: Any = None) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "serializer", serializer)
        object.__setattr__(self, "agg", agg)
        object.__setattr__(self, "ttl_s", ttl_s)
        object.__setattr__(self, "schema", schema)
        self._check()

    def _check(self) -> None:
        super()._check()
        check_protocol(self.agg, "agg", type(self).__name__,
                       ("create_accumulator", "add", "get_result"),
                       "an AggregateFunction (create_accumulator, add, get_result; merge for "
                       "namespace merges)")


# --------------------------------------------------------------------------- state shapes


class StateShape:
    """Converts one state kind between its heap object and its bytes form."""

    def __init__(self, kind: str, codec: Codec, key_codec: Codec | None = None) -> None:
        self.kind = kind
        self.codec = codec
        self.key_codec = key_codec

    def to_bytes(self, obj: Any) -> bytes:
        if self.kind == "list":
            enc = self.codec.encode
            return frame([enc(e) for e in obj])
        if self.kind == "map":
            assert self.key_codec is not None
            kenc, venc = self.key_codec.encode, self.codec.encode
            items: list[bytes] = []
            for k, v in obj.items():
                items.append(kenc(k))
                items.append(venc(v))
            return frame(items)
        return self.codec.encode(obj)

    def from_bytes(self, data: bytes) -> Any:
        """Decode a stored state (untrusted when restored: a map key must be hashable).

        Raises:
            CorruptObjectError: the bytes do not decode (named ``<state value>``).
        """
        if self.kind == "list":
            dec = self.codec.decode
            return [dec(e) for e in iter_framed(data)]
        if self.kind == "map":
            kdec, vdec = self.map_key, self.codec.decode
            return {kdec(k): vdec(v) for k, v in iter_pairs(data)}
        return self.codec.decode(data)

    def map_key(self, data: bytes) -> Any:
        """A map key from its bytes (hashable, or :class:`~dstl.errors.CorruptObjectError`)."""
        if self.key_codec is None:
            raise UsageError(f"a {self.kind} state has no map keys")
        return decode_hashable(self.key_codec, data, "map key")

    def stored(self, value: Any, encoded: bytes) -> Any:
        """What the heap keeps for a value written as ``encoded``: the object itself when it is
        immutable, else an independent copy equal to what the log says."""
        return value if type(value) in _IMMUTABLE else self.codec.decode(encoded)


class _NamingCodec:
    """Wraps a codec so encoding errors name the state (the value's type is in the message)."""

    __slots__ = ("_inner", "_state", "decode", "name")

    def __init__(self, inner: Codec, state: str) -> None:
        self._inner = inner
        self._state = state
        self.name = inner.name
        self.decode = inner.decode

    def encode(self, value: Any) -> bytes:
        try:
            return self._inner.encode(value)
        except UsageError as exc:
            raise UsageError(f"state {self._state!r}: {exc}") from exc


class _TypedCodec(_NamingCodec):
    """A declared state's codec: each value is checked against the declared type before it is
    encoded (a TTL state's values arrive as ``(expiry, value)`` pairs). Undeclared states keep
    :class:`_NamingCodec`, so their writes cost what they did."""

    __slots__ = ("_check", "_declared", "_key_of", "_pair")

    def __init__(self, inner: Codec, state: str, declared: Any, pair: bool,
                 key_of: Callable[[], Any]) -> None:
        super().__init__(inner, state)
        self._check = compile_checker(declared)
        self._declared = declared
        self._pair = pair
        self._key_of = key_of

    def encode(self, value: Any) -> bytes:
        v = value[1] if self._pair else value
        why = self._check(v) if v is not None else "null is not a value of a state"
        if why is not None:
            raise StateTypeError(self._state, self._key_of(), v, type_string(self._declared),
                                 why)
        return super().encode(value)


class StateAccess(Protocol):
    """What a state needs from its keyed backend: the state table's slot of the current key and
    namespace, and the log. Implemented by the backend's write path,
    :class:`~materializer.state_access.StateTableAccess` (and by the backend, which delegates to
    it).

    ``sid`` is the state's id in its backend. Values are the table's stored form: the object
    itself in a heap table, bytes (``shape.to_bytes``) in LMDB; :meth:`read_state` and
    :meth:`write_state_object` convert with ``shape``.
    """

    def get_current_key(self) -> Any:
        """The key state calls refer to (named in errors)."""

    @property
    def table_kind(self) -> str:
        """``"heap"`` (objects) or ``"lmdb"`` (bytes); fixed for the backend's lifetime."""
        ...

    def before_read(self) -> None:
        """Run pending work and check that a current key is set (raises ``UsageError``)."""

    def before_mutation(self) -> None:
        """Run pending work before a live heap object is mutated in place (a materialization
        must not start between reading the object and mutating it)."""

    def read_state(self, sid: int, shape: StateShape) -> Any:
        """The value of the current key and namespace (decoded), or ``None``."""

    def read_state_raw(self, sid: int) -> Any:
        """The stored form of the current key and namespace's value, not decoded."""

    def write_state(self, sid: int, value: Any) -> None:
        """Store ``value`` (already in the table's stored form) for the current key/namespace."""

    def write_state_object(self, sid: int, shape: StateShape, obj: Any) -> None:
        """Store the heap object ``obj``, encoded with ``shape`` when the table holds bytes."""

    def remove_state(self, sid: int) -> None:
        """Remove the current key and namespace's value."""

    def log_change(self, op: int, sid: int, payload: bytes) -> None:
        """Append one change record (op, state, current key and namespace, payload) to the log."""

    def merge_state_namespaces(self, sid: int, shape: StateShape, target: Any,
                               sources: Iterable[Any], fn: Callable[[Any, Any], Any]) -> None:
        """Merge the namespaces ``sources`` into ``target`` for the current key, logged as their
        effects."""


class RegisteredState(Protocol):
    """A backend's registration of one state, as restore and TTL read it: its id and its
    shape. Implemented by :class:`~materializer.state_registry.Registration`."""

    @property
    def state_id(self) -> int:
        """The state's id in its backend."""
        ...

    @property
    def shape(self) -> StateShape:
        """How the state's values are stored."""
        ...


class KeyedState:
    """The base of the state objects: one state of one backend, seen through
    :class:`StateAccess` at the backend's current key and namespace."""

    def __init__(self, backend: StateAccess, state_id: int,
                 descriptor: StateDescriptor, shape: StateShape) -> None:
        self._b = backend
        self._sid = state_id
        self.descriptor = descriptor
        self._shape = shape
        declared = descriptor.schema
        self._codec: Any = _NamingCodec(shape.codec, descriptor.name) if declared is None \
            else _TypedCodec(shape.codec, descriptor.name, declared,
                             shape.codec.name.startswith(TTL_CODEC_PREFIX),
                             backend.get_current_key)
        self._heap = backend.table_kind == "heap"  # read once: every mutation branches on it

    @property
    def name(self) -> str:
        return self.descriptor.name

    def clear(self) -> None:
        """Remove the state of the current key and namespace."""
        b = self._b
        b.remove_state(self._sid)
        b.log_change(CLEAR, self._sid, b"")

    def exists(self) -> bool:
        """Whether the current key and namespace has a value (Spark's ``exists``); lists and
        maps exist while they have an element (an emptied one is removed)."""
        b = self._b
        b.before_read()
        if self._shape.kind in ("list", "map"):
            return bool(b.read_state(self._sid, self._shape))
        return b.read_state_raw(self._sid) is not None

    def _read(self) -> Any:
        """The state for a caller: never the table's own mutable object."""
        b = self._b
        b.before_read()
        v = b.read_state(self._sid, self._shape)
        return copy_out(v) if self._heap else v

    def _live(self) -> Any:
        """The table's object (heap: copy-on-write safe to mutate in place), or a decoded one."""
        return self._b.read_state(self._sid, self._shape)


class ValueState(KeyedState):
    """A single value per key and namespace."""

    def value(self) -> Any:
        """The value, or ``None``."""
        v = self._read()
        return v

    def get(self) -> Any:
        """The value, or ``None`` when it does not exist (Spark's name for :meth:`value`)."""
        return self._read()

    def update(self, value: Any) -> None:
        """Set the value (``None`` clears it, as in Flink)."""
        if value is None:
            self.clear()
            return
        b = self._b
        vb = self._codec.encode(value)
        b.write_state(self._sid, self._shape.stored(value, vb) if self._heap else vb)
        b.log_change(SET, self._sid, vb)


class ListState(KeyedState):
    """A list per key and namespace."""

    def get(self) -> list[Any]:
        """A copy of the list (empty when unset)."""
        v = self._read()
        return v if v is not None else []

    def add(self, value: Any) -> None:
        b = self._b
        b.before_mutation()  # first: no materialization may start between _live() and the write
        eb = self._codec.encode(value)
        if self._heap:
            lst = self._live()
            if lst is None:
                b.write_state(self._sid, [self._shape.stored(value, eb)])
            else:
                lst.append(self._shape.stored(value, eb))
        else:
            b.write_state(self._sid, append_framed(b.read_state_raw(self._sid), [eb]))
        b.log_change(ADD_ELEMENT, self._sid, eb)

    def add_all(self, values: Iterable[Any]) -> None:
        values = list(values)
        if not values:
            return
        b = self._b
        b.before_mutation()
        enc = [self._codec.encode(v) for v in values]
        if self._heap:
            items = [self._shape.stored(v, e) for v, e in zip(values, enc)]
            lst = self._live()
            if lst is None:
                b.write_state(self._sid, items)
            else:
                lst.extend(items)
        else:
            b.write_state(self._sid, append_framed(b.read_state_raw(self._sid), enc))
        b.log_change(ADD, self._sid, frame(enc))

    def update(self, values: Iterable[Any]) -> None:
        """Replace the list (empty clears it)."""
        values = list(values)
        if not values:
            self.clear()
            return
        b = self._b
        enc = [self._codec.encode(v) for v in values]
        b.write_state_object(self._sid, self._shape,
                   [self._shape.stored(v, e) for v, e in zip(values, enc)])
        b.log_change(SET_INTERNAL, self._sid, frame(enc))

    def put(self, values: Iterable[Any]) -> None:
        """Replace the list (Spark's name for :meth:`update`; empty clears it)."""
        self.update(values)

    def append_value(self, value: Any) -> None:
        """Append one element (Spark's name for :meth:`add`)."""
        self.add(value)

    def append_list(self, values: Iterable[Any]) -> None:
        """Append the elements in order (Spark's name for :meth:`add_all`)."""
        self.add_all(values)

    def merge_namespaces(self, target: Any, sources: Iterable[Any]) -> None:
        """Append the lists of ``sources`` to ``target`` (in order) and clear the sources."""
        self._b.merge_state_namespaces(self._sid, self._shape, target, sources,
                                       lambda a, c: list(a) + list(c))


class MapEntry:
    """An entry seen through :meth:`MapState.iterator`; ``set_value`` is logged.

    It is also Spark's ``(key, value)`` pair: it unpacks (``for k, v in s.iterator()``),
    indexes (``[0]``, ``[1]``), has length 2 and equals the tuple ``(key, value)``.
    """

    __slots__ = ("_state", "key", "value")

    def __init__(self, state: MapState, key: Any, value: Any) -> None:
        self._state = state
        self.key = key
        self.value = value

    def _pair(self) -> tuple[Any, Any]:
        return (self.key, self.value)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._pair())

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> Any:
        return self._pair()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MapEntry):
            return self._pair() == other._pair()
        return isinstance(other, tuple) and self._pair() == other

    __hash__ = None  # type: ignore[assignment]  # mutable (set_value): not hashable

    def __repr__(self) -> str:
        return f"MapEntry({self.key!r}, {self.value!r})"

    def set_value(self, value: Any) -> None:
        self._state.put(self.key, value)
        self.value = value


class MapIterator(Iterator[MapEntry]):
    """Iterates a map state; ``remove()`` deletes the current entry and is logged."""

    def __init__(self, state: MapState, items: list[tuple[Any, Any]]) -> None:
        self._state = state
        self._items = iter(items)
        self._current: MapEntry | None = None

    def __next__(self) -> MapEntry:
        k, v = next(self._items)
        self._current = MapEntry(self._state, k, v)
        return self._current

    def remove(self) -> None:
        if self._current is None:
            raise UsageError("MapIterator.remove() before next() or twice for one entry")
        self._state.remove(self._current.key)
        self._current = None


class MapState(KeyedState):
    """A map per key and namespace."""

    def _map(self) -> dict[Any, Any]:
        """The live (heap) or decoded (LMDB) map; callers copy out what they return."""
        self._b.before_read()
        v = self._live()
        return v if v is not None else {}

    def get(self, key: Any) -> Any:
        return copy_out(self._map().get(key))

    def contains(self, key: Any) -> bool:
        return key in self._map()

    def put(self, key: Any, value: Any) -> None:
        b = self._b
        b.before_mutation()
        kb = self._shape.key_codec.encode(key)  # type: ignore[union-attr]
        vb = self._codec.encode(value)
        d = self._live()
        if d is None:
            b.write_state_object(self._sid, self._shape, {key: self._shape.stored(value, vb)})
        else:
            d[key] = self._shape.stored(value, vb)
            if not self._heap:
                b.write_state_object(self._sid, self._shape, d)
        b.log_change(ADD_OR_UPDATE_ELEMENT, self._sid, encode_map_entry(kb, vb))

    def put_all(self, entries: Mapping[Any, Any]) -> None:
        if not entries:
            return
        b = self._b
        b.before_mutation()
        kc = self._shape.key_codec
        assert kc is not None
        items: list[bytes] = []
        new = {}
        for k, v in entries.items():
            kb, vb = kc.encode(k), self._codec.encode(v)
            items.append(kb)
            items.append(vb)
            new[k] = self._shape.stored(v, vb)
        d = self._live()
        if d is None:
            b.write_state_object(self._sid, self._shape, new)
        else:
            d.update(new)
            if not self._heap:
                b.write_state_object(self._sid, self._shape, d)
        b.log_change(ADD, self._sid, frame(items))

    def remove(self, key: Any) -> None:
        b = self._b
        b.before_mutation()
        d = self._live()
        if d is None or key not in d:
            return
        kb = self._shape.key_codec.encode(key)  # type: ignore[union-attr]
        del d[key]
        if not d:
            b.remove_state(self._sid)
        elif not self._heap:
            b.write_state_object(self._sid, self._shape, d)
        b.log_change(REMOVE_ELEMENT, self._sid, kb)

    def get_value(self, key: Any) -> Any:
        """The value at ``key``, or ``None`` (Spark's name for :meth:`get`)."""
        return self.get(key)

    def contains_key(self, key: Any) -> bool:
        """Whether ``key`` is in the map (Spark's name for :meth:`contains`)."""
        return self.contains(key)

    def update_value(self, key: Any, value: Any) -> None:
        """Set the value at ``key`` (Spark's name for :meth:`put`)."""
        self.put(key, value)

    def remove_key(self, key: Any) -> None:
        """Remove ``key`` (absent: nothing happens; Spark's name for :meth:`remove`)."""
        self.remove(key)

    def keys(self) -> list[Any]:
        return copy_out(list(self._map().keys()))  # type: ignore[no-any-return]

    def values(self) -> list[Any]:
        return copy_out(list(self._map().values()))  # type: ignore[no-any-return]

    def items(self) -> list[tuple[Any, Any]]:
        return copy_out(list(self._map().items()))  # type: ignore[no-any-return]

    def is_empty(self) -> bool:
        return not self._map()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.keys())

    def iterator(self) -> MapIterator:
        """An iterator of :class:`MapEntry` whose ``remove``/``set_value`` are logged (each
        entry is also Spark's ``(key, value)`` pair)."""
        return MapIterator(self, self.items())


class ReducingState(KeyedState):
    """Values folded with the descriptor's reduce function."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        fn = self.descriptor.reduce_fn  # type: ignore[attr-defined]
        if fn is None:
            raise UsageError(f"reducing state {self.name!r} needs a reduce_fn")
        self._fn: Callable[[Any, Any], Any] = fn

    def get(self) -> Any:
        return self._read()

    def add(self, value: Any) -> None:
        b = self._b
        b.before_mutation()
        cur = self._live()
        new = value if cur is None else self._fn(copy_out(cur), value)
        nb = self._codec.encode(new)
        b.write_state(self._sid, self._shape.stored(new, nb) if self._heap else nb)
        b.log_change(SET_INTERNAL, self._sid, nb)  # the result, not the input: replay runs no UDF

    def merge_namespaces(self, target: Any, sources: Iterable[Any]) -> None:
        self._b.merge_state_namespaces(self._sid, self._shape, target, sources, self._fn)


class AggregatingState(KeyedState):
    """An accumulator driven by the descriptor's AggregateFunction."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        agg = self.descriptor.agg  # type: ignore[attr-defined]
        if agg is None:
            raise UsageError(f"aggregating state {self.name!r} needs an AggregateFunction")
        self._agg: AggregateFunction = agg

    def get(self) -> Any:
        acc = self._read()
        return None if acc is None else self._agg.get_result(acc)

    def add(self, value: Any) -> None:
        b = self._b
        b.before_mutation()
        cur = self._live()
        acc = self._agg.add(value, self._agg.create_accumulator() if cur is None
                            else copy_out(cur))
        ab = self._codec.encode(acc)
        b.write_state(self._sid, self._shape.stored(acc, ab) if self._heap else ab)
        b.log_change(SET_INTERNAL, self._sid, ab)

    def merge_namespaces(self, target: Any, sources: Iterable[Any]) -> None:
        self._b.merge_state_namespaces(self._sid, self._shape, target, sources, self._agg.merge)


STATE_CLASSES: dict[str, type[KeyedState]] = {
    "value": ValueState, "list": ListState, "map": MapState, "reducing": ReducingState,
    "aggregating": AggregatingState,
}
