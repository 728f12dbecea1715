"""State descriptors and the user-facing state objects (PyFlink's method names).

Every mutation is a double write: the backend's state table first, then one change record in the
log (:mod:`materializer.changes`). Reads never log. Reducing and aggregating ``add`` log the whole
new accumulator, and namespace merges log their effects, so replay never runs user functions.

Values returned by reads are the table's own objects for immutable values and copies otherwise;
mutating a returned container does not change state (and is not logged) — write it back with
``update``/``put``.

Representation per kind: on the heap a state is a Python object (value, ``list``, ``dict``); in
LMDB and in snapshots it is bytes: the codec's encoding for value/reducing/aggregating, a framed
list of encoded elements for lists, and framed (key, value) pairs for maps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

from dstl.errors import UsageError
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
from materializer.codecs import Codec, SafeCodec

if TYPE_CHECKING:
    from materializer.backend import ChangelogKeyedStateBackend

__all__ = [
    "AggregateFunction",
    "AggregatingState",
    "AggregatingStateDescriptor",
    "ListState",
    "ListStateDescriptor",
    "MapEntry",
    "MapState",
    "MapStateDescriptor",
    "ReducingState",
    "ReducingStateDescriptor",
    "StateDescriptor",
    "ValueState",
    "ValueStateDescriptor",
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


@dataclass(frozen=True)
class StateDescriptor:
    """Base of all descriptors: a name and an optional value codec (default: the safe codec)."""

    name: str
    serializer: Codec | None = None
    kind: str = field(default="", init=False)

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

    def key_codec(self) -> Codec:
        return self.key_serializer if self.key_serializer is not None else SafeCodec()


@dataclass(frozen=True)
class ReducingStateDescriptor(StateDescriptor):
    reduce_fn: Callable[[Any, Any], Any] | None = None
    kind: str = field(default="reducing", init=False)

    def __init__(self, name: str, reduce_fn: Callable[[Any, Any], Any],
                 serializer: Codec | None = None) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "serializer", serializer)
        object.__setattr__(self, "reduce_fn", reduce_fn)


@dataclass(frozen=True)
class AggregatingStateDescriptor(StateDescriptor):
    agg: AggregateFunction | None = None
    kind: str = field(default="aggregating", init=False)

    def __init__(self, name: str, agg: AggregateFunction,
                 serializer: Codec | None = None) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "serializer", serializer)
        object.__setattr__(self, "agg", agg)


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
        if self.kind == "list":
            dec = self.codec.decode
            return [dec(e) for e in iter_framed(data)]
        if self.kind == "map":
            assert self.key_codec is not None
            kdec, vdec = self.key_codec.decode, self.codec.decode
            return {kdec(k): vdec(v) for k, v in iter_pairs(data)}
        return self.codec.decode(data)

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


class _State:
    def __init__(self, backend: ChangelogKeyedStateBackend, state_id: int,
                 descriptor: StateDescriptor, shape: StateShape) -> None:
        self._b = backend
        self._sid = state_id
        self.descriptor = descriptor
        self._shape = shape
        self._codec: Any = _NamingCodec(shape.codec, descriptor.name)

    @property
    def name(self) -> str:
        return self.descriptor.name

    def clear(self) -> None:
        """Remove the state of the current key and namespace."""
        b = self._b
        b._remove(self._sid)
        b._log(CLEAR, self._sid, b"")

    def _read(self) -> Any:
        """The state for a caller: never the table's own mutable object."""
        b = self._b
        b._check_read()
        v = b._get(self._sid, self._shape)
        return copy_out(v) if b._heap else v

    def _live(self) -> Any:
        """The table's object (heap: copy-on-write safe to mutate in place), or a decoded one."""
        return self._b._get(self._sid, self._shape)


class ValueState(_State):
    """A single value per key and namespace."""

    def value(self) -> Any:
        """The value, or ``None``."""
        v = self._read()
        return v

    def update(self, value: Any) -> None:
        """Set the value (``None`` clears it, as in Flink)."""
        if value is None:
            self.clear()
            return
        b = self._b
        vb = self._codec.encode(value)
        b._put(self._sid, self._shape.stored(value, vb) if b._heap else vb)
        b._log(SET, self._sid, vb)


class ListState(_State):
    """A list per key and namespace."""

    def get(self) -> list[Any]:
        """A copy of the list (empty when unset)."""
        v = self._read()
        return v if v is not None else []

    def add(self, value: Any) -> None:
        b = self._b
        b._touch()  # first: a materialization must not start between _live() and the mutation
        eb = self._codec.encode(value)
        if b._heap:
            lst = self._live()
            if lst is None:
                b._put(self._sid, [self._shape.stored(value, eb)])
            else:
                lst.append(self._shape.stored(value, eb))
        else:
            b._put(self._sid, append_framed(b._get_raw(self._sid), [eb]))
        b._log(ADD_ELEMENT, self._sid, eb)

    def add_all(self, values: Iterable[Any]) -> None:
        values = list(values)
        if not values:
            return
        b = self._b
        b._touch()
        enc = [self._codec.encode(v) for v in values]
        if b._heap:
            items = [self._shape.stored(v, e) for v, e in zip(values, enc)]
            lst = self._live()
            if lst is None:
                b._put(self._sid, items)
            else:
                lst.extend(items)
        else:
            b._put(self._sid, append_framed(b._get_raw(self._sid), enc))
        b._log(ADD, self._sid, frame(enc))

    def update(self, values: Iterable[Any]) -> None:
        """Replace the list (empty clears it)."""
        values = list(values)
        if not values:
            self.clear()
            return
        b = self._b
        enc = [self._codec.encode(v) for v in values]
        b._put_obj(self._sid, self._shape,
                   [self._shape.stored(v, e) for v, e in zip(values, enc)])
        b._log(SET_INTERNAL, self._sid, frame(enc))

    def merge_namespaces(self, target: Any, sources: Iterable[Any]) -> None:
        """Append the lists of ``sources`` to ``target`` (in order) and clear the sources."""
        self._b._merge(self, target, sources, lambda a, c: list(a) + list(c))


class MapEntry:
    """An entry seen through :meth:`MapState.iterator`; ``set_value`` is logged."""

    __slots__ = ("_state", "key", "value")

    def __init__(self, state: MapState, key: Any, value: Any) -> None:
        self._state = state
        self.key = key
        self.value = value

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


class MapState(_State):
    """A map per key and namespace."""

    def _map(self) -> dict[Any, Any]:
        """The live (heap) or decoded (LMDB) map; callers copy out what they return."""
        self._b._check_read()
        v = self._live()
        return v if v is not None else {}

    def get(self, key: Any) -> Any:
        return copy_out(self._map().get(key))

    def contains(self, key: Any) -> bool:
        return key in self._map()

    def put(self, key: Any, value: Any) -> None:
        b = self._b
        b._touch()
        kb = self._shape.key_codec.encode(key)  # type: ignore[union-attr]
        vb = self._codec.encode(value)
        d = self._live()
        if d is None:
            b._put_obj(self._sid, self._shape, {key: self._shape.stored(value, vb)})
        else:
            d[key] = self._shape.stored(value, vb)
            if not b._heap:
                b._put_obj(self._sid, self._shape, d)
        b._log(ADD_OR_UPDATE_ELEMENT, self._sid, encode_map_entry(kb, vb))

    def put_all(self, entries: Mapping[Any, Any]) -> None:
        if not entries:
            return
        b = self._b
        b._touch()
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
            b._put_obj(self._sid, self._shape, new)
        else:
            d.update(new)
            if not b._heap:
                b._put_obj(self._sid, self._shape, d)
        b._log(ADD, self._sid, frame(items))

    def remove(self, key: Any) -> None:
        b = self._b
        b._touch()
        d = self._live()
        if d is None or key not in d:
            return
        kb = self._shape.key_codec.encode(key)  # type: ignore[union-attr]
        del d[key]
        if not d:
            b._remove(self._sid)
        elif not b._heap:
            b._put_obj(self._sid, self._shape, d)
        b._log(REMOVE_ELEMENT, self._sid, kb)

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
        """An iterator of :class:`MapEntry` whose ``remove``/``set_value`` are logged."""
        return MapIterator(self, self.items())


class ReducingState(_State):
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
        b._touch()
        cur = self._live()
        new = value if cur is None else self._fn(copy_out(cur), value)
        nb = self._codec.encode(new)
        b._put(self._sid, self._shape.stored(new, nb) if b._heap else nb)
        b._log(SET_INTERNAL, self._sid, nb)  # the result, not the input: replay runs no UDF

    def merge_namespaces(self, target: Any, sources: Iterable[Any]) -> None:
        self._b._merge(self, target, sources, self._fn)


class AggregatingState(_State):
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
        b._touch()
        cur = self._live()
        acc = self._agg.add(value, self._agg.create_accumulator() if cur is None
                            else copy_out(cur))
        ab = self._codec.encode(acc)
        b._put(self._sid, self._shape.stored(acc, ab) if b._heap else ab)
        b._log(SET_INTERNAL, self._sid, ab)

    def merge_namespaces(self, target: Any, sources: Iterable[Any]) -> None:
        self._b._merge(self, target, sources, self._agg.merge)


STATE_CLASSES: dict[str, type[_State]] = {
    "value": ValueState, "list": ListState, "map": MapState, "reducing": ReducingState,
    "aggregating": AggregatingState,
}
