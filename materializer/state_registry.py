"""``StateRegistry``: the states of one keyed backend — their ids, shapes and metadata.

Theory of operation
-------------------
- **One registration per state name.** A state is registered by its descriptor
  (:meth:`StateRegistry.register`, the backend's ``get_state``), as an internal raw index
  (:meth:`StateRegistry.register_raw`: bytes in, bytes stored, no codec), or from a snapshot's
  or the log's metadata (:meth:`StateRegistry.register_restored`; its descriptor comes later,
  when the user opens it). Ids are small ints, dense from 0, stable across restores (a restored
  state keeps its id when that id is free).
- **Metadata records.** :attr:`StateRegistry.logged` holds the ids whose metadata record is in
  the log since the last cut (a materialization or a checkpoint); the write path logs the record
  before a state's first change after it, so the log after any cut describes its states.
- The registry owns no table and no log: converting stored values to a newly declared type
  (:mod:`materializer.declared_types`) and writing them is the caller's, through the ``adopt``
  hook of :meth:`StateRegistry.register`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from dstl.errors import StateError, UsageError
from materializer.codecs import TTL_CODEC_PREFIX, BytesCodec, SafeCodec, TtlCodec, codec_by_name
from materializer.schema import record as record_schema
from materializer.states import STATE_CLASSES, KeyedState, StateDescriptor, StateShape

__all__ = ["MAX_STATES", "Registration", "StateRegistry"]

#: The most states one backend registers (ids fit the change records' state id field).
MAX_STATES: Final = 65536

#: ``adopt(registration, new shape, declared type, new metadata)``: a restored state is opened
#: under a declared type (see :mod:`materializer.declared_types`).
AdoptDeclared = Callable[["Registration", StateShape, Any, dict[str, Any]], None]


@dataclass
class Registration:
    """One state of a backend (a :class:`~materializer.states.RegisteredState`)."""

    state_id: int
    descriptor: StateDescriptor | None  # None: known from a restore, not yet re-registered
    shape: StateShape
    meta: dict[str, Any]
    state: KeyedState | None = None


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


class StateRegistry:
    """The registrations of one backend's states (see the module docstring).

    Args:
        owner: the backend's operator id (in messages).
        max_value_decoded_bytes: the decoded-size limit of the default (safe) codecs.
    """

    def __init__(self, owner: str, max_value_decoded_bytes: int) -> None:
        self._owner = owner
        self._limit = max_value_decoded_bytes
        self.by_name: dict[str, Registration] = {}
        self.by_id: dict[int, Registration] = {}
        #: raw states (internal indexes): no codecs applied
        self.raw: set[int] = set()
        #: states whose metadata record is in the log since the last cut (cleared, never replaced)
        self.logged: set[int] = set()

    # ------------------------------------------------------------------ lookups

    def get(self, state_id: int) -> Registration | None:
        return self.by_id.get(state_id)

    def names(self) -> list[str]:
        return sorted(self.by_name)

    def internal_ids(self) -> list[int]:
        """Ids of the raw indexes and of the states whose name starts with ``$``."""
        return sorted(sid for sid, reg in self.by_id.items()
                      if sid in self.raw or str(reg.meta["name"]).startswith("$"))

    def metadata(self) -> dict[int, dict[str, Any]]:
        """Every state's metadata by id (copies)."""
        return {sid: dict(r.meta) for sid, r in sorted(self.by_id.items())}

    def metas(self) -> dict[str, dict[str, Any]]:
        """Every state's metadata by id as a string, as snapshots and markers record them."""
        return {str(r.state_id): r.meta for r in self.by_id.values()}

    def forget_logged(self) -> None:
        """A cut: the log after it must describe its states again."""
        self.logged.clear()

    # ------------------------------------------------------------------ registration

    def _next_id(self) -> int:
        if len(self.by_id) >= MAX_STATES:
            raise UsageError(f"backend {self._owner!r} has {MAX_STATES} states; no more can be "
                             "registered")
        return max(self.by_id, default=-1) + 1

    def _add(self, name: str, reg: Registration) -> None:
        self.by_name[name] = reg
        self.by_id[reg.state_id] = reg

    def register(self, descriptor: StateDescriptor, adopt: AdoptDeclared) -> Registration:
        """The registration of ``descriptor``'s state: the open one as it is (its ``state``
        set), or a new or restored one described anew (its ``state`` to be made by the caller).

        Raises:
            UsageError: not a descriptor, a bad name, an internal index's name, another kind
                or TTL-ness than the open state, or too many states.
            StateError: a restored state opened with the other TTL-ness.
        """
        if not isinstance(descriptor, StateDescriptor) or descriptor.kind not in STATE_CLASSES:
            raise UsageError(f"not a state descriptor: {descriptor!r}")
        if not isinstance(descriptor.name, str) or not 0 < len(descriptor.name) <= 255:
            raise UsageError(f"state name {descriptor.name!r} is invalid: expected a non-empty "
                             "string of at most 255 characters")
        reg = self.by_name.get(descriptor.name)
        if reg is not None and reg.state_id in self.raw:
            raise UsageError(f"state {descriptor.name!r} is an internal index of backend "
                             f"{self._owner!r}; choose another state name")
        ttl = descriptor.ttl_s is not None
        if reg is not None and reg.state is not None:
            if reg.meta["kind"] != descriptor.kind:
                raise UsageError(f"state {descriptor.name!r} is a {reg.meta['kind']} state; it "
                                 f"cannot be opened as a {descriptor.kind} state")
            if isinstance(reg.shape.codec, TtlCodec) != ttl:
                raise UsageError(f"state {descriptor.name!r} is open "
                                 f"{'with' if not ttl else 'without'} a TTL; it cannot be "
                                 f"opened {'with' if ttl else 'without'} one in the same backend")
            return reg
        if reg is not None and reg.meta["kind"] != descriptor.kind:
            raise UsageError(f"state {descriptor.name!r} was restored as a {reg.meta['kind']} "
                             f"state; it cannot be opened as a {descriptor.kind} state")
        # The safe codec by default, with this backend's decoded-size limit.
        limit = self._limit
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
                adopt(reg, shape, descriptor.schema, meta)
        if reg is None:
            reg = Registration(self._next_id(), descriptor, shape, meta)
            self._add(descriptor.name, reg)
        else:
            if reg.meta != meta:
                self.logged.discard(reg.state_id)  # the log must describe it anew
            reg.descriptor, reg.shape, reg.meta = descriptor, shape, meta
        return reg

    def register_raw(self, name: str) -> int:
        """Register (or look up) the raw state ``name``; returns its state id.

        Raises:
            UsageError: a state of that name exists and is not raw, or too many states.
        """
        reg = self.by_name.get(name)
        if reg is not None:
            if reg.state_id not in self.raw:
                raise UsageError(f"state {name!r} of backend {self._owner!r} is a "
                                 f"{reg.meta['kind']} state, not an internal index")
            return reg.state_id
        sid = self._next_id()
        meta = {"name": name, "kind": "value", "value_codec": BytesCodec.name,
                "key_codec": None, "raw": True}
        self._add(name, Registration(sid, None, StateShape("value", BytesCodec()), meta))
        self.raw.add(sid)
        return sid

    def register_restored(self, meta: dict[str, Any], preferred_id: int, *,
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
        existing = self.by_name.get(name)
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
        limit = self._limit
        vc, kc = meta.get("value_codec") or "safe", meta.get("key_codec")
        codec = codec_by_name(vc, allow_pickle=allow_pickle, max_decoded_bytes=limit)
        # a map's keys have a codec (the safe one unless the descriptor named another)
        key_codec = codec_by_name(kc or "safe", allow_pickle=allow_pickle,
                                  max_decoded_bytes=limit) if kind == "map" else None
        sid = preferred_id if preferred_id not in self.by_id and 0 <= preferred_id < MAX_STATES \
            else max(self.by_id, default=-1) + 1
        self._add(name, Registration(sid, None, StateShape(kind, codec, key_codec), dict(meta)))
        if meta.get("raw") is True:
            if kind != "value" or codec.name != "bytes":
                raise StateError(f"raw state {name!r} must be a value state of bytes, not "
                                 f"{kind}/{codec.name}")
            self.raw.add(sid)
        return sid
