"""Heap state table of ONE registered state: one :class:`CopyOnWriteStateMap` per key group.

Theory of operation
-------------------
As Flink's ``CopyOnWriteStateTable``: the owner's key-group range is split into one map per key
group, so a snapshot is a list of per-key-group map snapshots and the write-out can go key group
by key group, releasing each map snapshot as soon as its key group is written (the live map stops
copying for that key group from then on). Maps are created on the first write to their key group,
so a backend owning thousands of key groups does not pay for empty bucket arrays.

Concurrency is the map's: one writer thread for reads, writes and ``snapshot()``; a table snapshot
may be written out and released on another thread while the writer continues.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from types import TracebackType
from typing import Generic, TypeVar

from dstl.errors import ClosedError, KeyGroupError
from dstl.keygroups import KeyGroupRange
from materializer.cow_map import (
    DEFAULT_CAPACITY,
    CopyOnWriteStateMap,
    CopyOnWriteStateMapSnapshot,
)

__all__ = ["CopyOnWriteStateTable", "CopyOnWriteStateTableSnapshot"]

K = TypeVar("K", bound=Hashable)
N = TypeVar("N", bound=Hashable)
S = TypeVar("S")


class CopyOnWriteStateTable(Generic[K, N, S]):
    """States of one registered state over a key-group range, with async snapshots.

    Args:
        key_groups: the owner's key-group range; every operation checks its key group against it.
        copier: passed to every map (see :class:`CopyOnWriteStateMap`).
        initial_capacity: bucket count of each key group's map when it is created.
    """

    __slots__ = ("_copier", "_initial_capacity", "_key_groups", "_maps", "_start")

    def __init__(self, key_groups: KeyGroupRange, copier: Callable[[S], S] | None = None, *,
                 initial_capacity: int = DEFAULT_CAPACITY) -> None:
        self._key_groups = key_groups
        self._start = key_groups.start
        self._copier = copier
        self._initial_capacity = initial_capacity
        self._maps: list[CopyOnWriteStateMap[K, N, S] | None] = [None] * len(key_groups)

    @property
    def key_groups(self) -> KeyGroupRange:
        return self._key_groups

    def _index(self, key_group: int) -> int:
        i = key_group - self._start
        if 0 <= i < len(self._maps) and type(key_group) is int:
            return i
        raise KeyGroupError(key_group, "CopyOnWriteStateTable", self._key_groups,
                            hint="route the key to the backend owning its key group")

    def map_for(self, key_group: int) -> CopyOnWriteStateMap[K, N, S]:
        """The map of ``key_group`` (created if needed)."""
        i = self._index(key_group)
        m = self._maps[i]
        if m is None:
            m = self._maps[i] = CopyOnWriteStateMap(self._copier,
                                                    initial_capacity=self._initial_capacity)
        return m

    def get(self, key: K, key_group: int, namespace: N) -> S | None:
        """State of ``(key, namespace)`` in ``key_group`` or None (copy rules: see the map)."""
        m = self._maps[self._index(key_group)]
        return None if m is None else m.get(key, namespace)

    def put(self, key: K, key_group: int, namespace: N, state: S) -> None:
        """Set the state of ``(key, namespace)`` in ``key_group``."""
        m = self._maps[self._index(key_group)]
        if m is None:
            m = self.map_for(key_group)
        m.put(key, namespace, state)

    def remove(self, key: K, key_group: int, namespace: N) -> bool:
        """Remove ``(key, namespace)``; True if it was present."""
        m = self._maps[self._index(key_group)]
        return False if m is None else m.remove(key, namespace)

    def contains_key(self, key: K, key_group: int, namespace: N) -> bool:
        m = self._maps[self._index(key_group)]
        return False if m is None else m.contains_key(key, namespace)

    def __len__(self) -> int:
        return sum(len(m) for m in self._maps if m is not None)

    def len(self) -> int:
        """Entries over all key groups (same as ``len(table)``)."""
        return len(self)

    def sample(self, n: int) -> list[tuple[K, N, S]]:
        """Up to ``n`` entries taken from the key groups' maps in turn (a few from each, no
        snapshot; see :meth:`CopyOnWriteStateMap.sample`)."""
        maps = [m for m in self._maps if m is not None and len(m)]
        per_map = max(1, -(-n // max(1, len(maps))))
        out: list[tuple[K, N, S]] = []
        for m in maps:
            out.extend(m.sample(min(per_map, n - len(out))))
            if len(out) >= n:
                break
        return out

    def structure_bytes(self) -> int:
        """Bytes of the maps' bucket arrays and entry objects."""
        return sum(m.structure_bytes() for m in self._maps if m is not None)

    def entries(self, key_group: int) -> Iterator[tuple[K, N, S]]:
        """``(key, namespace, state)`` of one key group as of this call (see the map's
        ``entries``: writes while iterating are allowed; states are read-only)."""
        m = self._maps[self._index(key_group)]
        return iter(()) if m is None else m.entries()

    def snapshot(self) -> CopyOnWriteStateTableSnapshot[K, N, S]:
        """Snapshot every key group's map (call on the writer thread)."""
        snaps: dict[int, CopyOnWriteStateMapSnapshot[K, N, S]] = {}
        for i, m in enumerate(self._maps):
            if m is not None and len(m):
                snaps[self._start + i] = m.snapshot()
        return CopyOnWriteStateTableSnapshot(self._key_groups, snaps)


class CopyOnWriteStateTableSnapshot(Generic[K, N, S]):
    """One map snapshot per non-empty key group of a :class:`CopyOnWriteStateTable`.

    Write it out key group by key group with :meth:`entries` and :meth:`release_key_group`;
    :meth:`release` releases whatever is left (idempotent; also the context-manager exit).
    """

    __slots__ = ("_key_groups", "_released", "_snaps")

    def __init__(self, key_groups: KeyGroupRange,
                 snaps: dict[int, CopyOnWriteStateMapSnapshot[K, N, S]]) -> None:
        self._key_groups = key_groups
        self._snaps = snaps
        self._released = False

    @property
    def key_groups(self) -> KeyGroupRange:
        return self._key_groups

    def __len__(self) -> int:
        return sum(len(s) for s in self._snaps.values())

    def entries(self, key_group: int) -> Iterator[tuple[K, N, S]]:
        """``(key, namespace, state)`` of ``key_group`` frozen at the snapshot.

        Raises:
            KeyGroupError: ``key_group`` is outside the table's range.
            ClosedError: the snapshot (or this key group) was already released.
        """
        if key_group not in self._key_groups:
            raise KeyGroupError(key_group, "CopyOnWriteStateTableSnapshot", self._key_groups)
        if self._released:
            raise ClosedError("state table snapshot", hint="take a new snapshot")
        snap = self._snaps.get(key_group)
        return iter(()) if snap is None else iter(snap)

    def has_key_group(self, key_group: int) -> bool:
        """True if ``key_group`` had entries at the snapshot and is not released yet."""
        snap = self._snaps.get(key_group)
        return snap is not None and not snap.released

    def release_key_group(self, key_group: int) -> None:
        """Release the map snapshot of one key group (after it was written). Idempotent."""
        snap = self._snaps.get(key_group)
        if snap is not None:
            snap.release()

    def release(self) -> None:
        """Release every map snapshot still held. Idempotent."""
        self._released = True
        for snap in self._snaps.values():
            snap.release()

    def __enter__(self) -> CopyOnWriteStateTableSnapshot[K, N, S]:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
