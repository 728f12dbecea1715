"""Copy-on-write hash map of one key group's states (Flink's ``CopyOnWriteStateMap``).

Theory of operation
-------------------
The map is a bucket array of chained entries, keyed by ``(key, namespace)``. Every entry holds
``key, namespace, state, hash, next`` and two versions: ``entry_version`` (the map version when the
entry object was created or copied) and ``state_version`` (the map version when its state was last
written or handed out for mutation). The map holds ``state_map_version`` (``_version``), the set of
running snapshot versions and ``highest_required_snapshot_version`` (``_highest_required``; 0 when no
snapshot runs).

Snapshot (:meth:`CopyOnWriteStateMap.snapshot`):
    bump the map version, register it as a running snapshot (it becomes the highest required
    version) and shallow-copy the bucket array. During an incremental rehash the copy is laid out
    as in Flink: the un-migrated buckets of the primary table (``primary[rehash_index:]``), then the
    migrated low half of the new table (``new[:rehash_index]``), then its high half
    (``new[half:half + rehash_index]``). Only references are copied; the snapshot and the live map
    share every entry and state object.

Copy-on-write rules (an entry is shared with some snapshot iff ``entry_version < highest``):
    * put of an existing entry ``e`` that is shared copies ``e`` and every shared entry before it in
      its chain (the chain is singly linked, so a predecessor cannot point at two versions of
      ``e``); entries after ``e`` stay shared. The copies get ``entry_version = state_map_version``.
    * get of an entry whose ``state_version < highest`` hands out a copy of the state (made by the
      copier) after copying the chain as for a put, so a caller mutating the returned state cannot
      reach a snapshot. Immutable states (int, float, complex, str, bytes, bool, None, and tuples of
      those) are returned as they are: no copier call, no chain copy (the fast path).
    * remove of a non-head entry copies its shared predecessors the same way and unlinks it from
      the copy; removing a head only rewrites the live bucket array, which the snapshot copied.
    * a new entry is inserted at the chain head; it is never shared.
    * release of a snapshot removes its version and recomputes ``highest`` (0 if none remain).
      Entries copied while it ran become garbage once the snapshot's bucket copy is dropped.

Incremental rehash: when an insert finds ``size > threshold`` (0.75 x capacity) a table of twice
the size is allocated and every get/put/remove/contains_key first migrates at least
``MIN_TRANSFERRED_PER_INCREMENTAL_REHASH`` (4) entries, always whole buckets, from the primary
table. Bucket ``i`` of the primary table lives in the new table iff ``i < rehash_index``. Shared
entries are copied when migrated (their ``next`` changes); exclusive ones are relinked in place.

Concurrency (what is allowed; CPython with the GIL):
    * ONE writer thread calls get/put/remove/contains_key/entries/snapshot (``get`` may mutate the
      map: it migrates buckets and copies entries). These calls are not thread-safe among
      themselves; the owner serialises them (as Flink's task thread does).
    * A snapshot may be iterated and released on any other thread while the writer continues:
      entries reachable from a snapshot's bucket copy are never mutated while it is registered
      (they all have ``entry_version < snapshot version <= highest``), and the version set is
      guarded by a lock shared by ``snapshot()`` and ``release()``. A writer that read a stale,
      higher ``highest`` only copies more than needed, which is safe.
    * Snapshot contents are read-only for their consumer: states are shared with the live map.
    * A state object obtained from ``get``/``put`` before a snapshot must not be mutated after it;
      call ``get`` again (the backend always does get -> modify -> put).

Costs: ``snapshot()`` is O(capacity) reference copies on the writer thread; the default copier is
``copy.deepcopy`` (generic but slow: ~1-10 us for small containers), so pass a specialised copier
(or use immutable states) when states are mutable and large.
"""

from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Callable, Hashable, Iterator
from types import TracebackType
from typing import Any, Final, Generic, TypeVar

from dstl.errors import ClosedError, ConfigError

__all__ = [
    "DEFAULT_CAPACITY",
    "MAXIMUM_CAPACITY",
    "MINIMUM_CAPACITY",
    "MIN_TRANSFERRED_PER_INCREMENTAL_REHASH",
    "CopyOnWriteStateMap",
    "CopyOnWriteStateMapSnapshot",
    "is_immutable",
]

K = TypeVar("K", bound=Hashable)
N = TypeVar("N", bound=Hashable)
S = TypeVar("S")

#: Flink's default bucket count of a new map.
DEFAULT_CAPACITY: Final = 128
#: Smallest bucket array (tests use it to make rehashes frequent).
MINIMUM_CAPACITY: Final = 4
#: Largest bucket array; beyond it the map stops growing and chains get longer (Flink: 2**30).
MAXIMUM_CAPACITY: Final = 1 << 30
#: Entries (whole buckets) every operation migrates during an incremental rehash (Flink: 4).
MIN_TRANSFERRED_PER_INCREMENTAL_REHASH: Final = 4

_ATOMIC_IMMUTABLE: Final = frozenset({int, float, complex, str, bytes, bool, type(None)})
_EMPTY_TABLE: Final[list[Any]] = []  # "not rehashing"; falsy, never written to


def is_immutable(value: object) -> bool:
    """True if ``value`` can be shared without copying.

    Exact types only (a subclass of ``int`` may carry mutable attributes): int, float, complex,
    str, bytes, bool, None, and tuples whose items are all immutable (recursively).
    """
    t = type(value)
    if t in _ATOMIC_IMMUTABLE:
        return True
    if t is tuple:
        return all(is_immutable(item) for item in value)  # type: ignore[attr-defined]
    return False


class _Entry:
    """One chained entry. Slotted: ~40% smaller and faster attribute access than a dict."""

    __slots__ = ("entry_version", "hash", "key", "namespace", "next", "state", "state_version")

    def __init__(self, key: Any, namespace: Any, state: Any, hash_: int, next_: _Entry | None,
                 entry_version: int, state_version: int) -> None:
        self.key = key
        self.namespace = namespace
        self.state = state
        self.hash = hash_
        self.next = next_
        self.entry_version = entry_version
        self.state_version = state_version


#: Bytes of one entry object (slotted, seven references).
_ENTRY_BYTES: Final = sys.getsizeof(_Entry(None, None, None, 0, None, 0, 0))


def _default_copier(state: Any) -> Any:
    return copy.deepcopy(state)


class CopyOnWriteStateMap(Generic[K, N, S]):
    """Hash map ``(key, namespace) -> state`` with cheap, consistent snapshots.

    See the module docstring for the copy-on-write rules and the allowed concurrency.

    Args:
        copier: makes an independent copy of a mutable state; called only when a ``get`` hands
            out a state that a running snapshot shares. ``None``: ``copy.deepcopy``. Immutable
            states never reach the copier.
        initial_capacity: initial bucket count, rounded up to a power of two, at least
            ``MINIMUM_CAPACITY``.

    Raises:
        ConfigError: ``initial_capacity`` is not a positive int.
    """

    __slots__ = ("__weakref__", "_copier", "_highest_required", "_mod_count", "_primary",
                 "_primary_size", "_rehash_index", "_rehash_size", "_rehash_table",
                 "_snapshot_versions", "_threshold", "_version", "_versions_lock")

    def __init__(self, copier: Callable[[S], S] | None = None, *,
                 initial_capacity: int = DEFAULT_CAPACITY) -> None:
        if (isinstance(initial_capacity, bool) or not isinstance(initial_capacity, int)
                or initial_capacity < 1):
            raise ConfigError("initial_capacity", initial_capacity, "an int >= 1",
                              owner="CopyOnWriteStateMap")
        capacity = MINIMUM_CAPACITY
        while capacity < initial_capacity and capacity < MAXIMUM_CAPACITY:
            capacity <<= 1
        self._copier: Callable[[Any], Any] = copier if copier is not None else _default_copier
        self._primary: list[_Entry | None] = [None] * capacity
        self._rehash_table: list[_Entry | None] = _EMPTY_TABLE
        self._rehash_index = 0
        self._primary_size = 0
        self._rehash_size = 0
        self._threshold = (capacity >> 1) + (capacity >> 2)  # 0.75 x capacity
        self._version = 0
        self._snapshot_versions: set[int] = set()
        self._highest_required = 0
        self._versions_lock = threading.Lock()
        self._mod_count = 0

    # ------------------------------------------------------------------ reads

    def __len__(self) -> int:
        return self._primary_size + self._rehash_size

    def get(self, key: K, namespace: N) -> S | None:
        """The state of ``(key, namespace)``, or ``None``.

        A mutable state that a running snapshot shares is copied first, so the caller may mutate
        the returned object (and must ``put`` it back for the change to be logged by a backend).
        """
        if self._rehash_table:
            self._incremental_rehash()
        h = hash((key, namespace))
        tab = self._primary
        idx = h & (len(tab) - 1)
        if idx < self._rehash_index:
            tab = self._rehash_table
            idx = h & (len(tab) - 1)
        e = tab[idx]
        while e is not None:
            if e.hash == h and e.key == key and e.namespace == namespace:
                if e.state_version < self._highest_required:
                    return self._state_for_caller(tab, idx, e)  # type: ignore[no-any-return]
                return e.state  # type: ignore[no-any-return]
            e = e.next
        return None

    def contains_key(self, key: K, namespace: N) -> bool:
        """True if ``(key, namespace)`` has a state. Never copies anything."""
        if self._rehash_table:
            self._incremental_rehash()
        h = hash((key, namespace))
        tab = self._primary
        idx = h & (len(tab) - 1)
        if idx < self._rehash_index:
            tab = self._rehash_table
            idx = h & (len(tab) - 1)
        e = tab[idx]
        while e is not None:
            if e.hash == h and e.key == key and e.namespace == namespace:
                return True
            e = e.next
        return False

    # ------------------------------------------------------------------ writes

    def put(self, key: K, namespace: N, state: S) -> None:
        """Set the state of ``(key, namespace)``; the map keeps a reference to ``state``."""
        if self._rehash_table:
            self._incremental_rehash()
        h = hash((key, namespace))
        tab = self._primary
        idx = h & (len(tab) - 1)
        if idx < self._rehash_index:
            tab = self._rehash_table
            idx = h & (len(tab) - 1)
        head = e = tab[idx]
        while e is not None:
            if e.hash == h and e.key == key and e.namespace == namespace:
                required = self._highest_required
                if e.entry_version < required:
                    e = self._copy_chain(tab, idx, e, required)
                e.state = state
                e.state_version = self._version
                return
            e = e.next
        self._mod_count += 1
        if self._primary_size + self._rehash_size > self._threshold and not self._rehash_table:
            # Only allocates the new table with rehash_index = 0, so `tab`/`idx` stay valid.
            self._double_capacity()
        version = self._version
        tab[idx] = _Entry(key, namespace, state, h, head, version, version)
        if tab is self._primary:
            self._primary_size += 1
        else:
            self._rehash_size += 1

    def put_all(self, items: list[tuple[K, N, S]], *, distinct: bool = False) -> None:
        """:meth:`put` of every ``(key, namespace, state)`` in order (a later item of the same
        key wins): the bulk path of a restore. ``distinct``: the items' keys are distinct (a
        snapshot's), so the array is sized for all of them at once.

        When no snapshot is running and no rehash is in flight (a restore fills a map nobody
        snapshots yet) the items go straight into the bucket array, and a full array is doubled
        at once instead of incrementally: no copy-on-write or migration step per item. Otherwise
        each item is an ordinary :meth:`put`.
        """
        if self._highest_required or self._rehash_table:
            for key, namespace, state in items:
                self.put(key, namespace, state)
            return
        self._mod_count += 1
        if distinct and self._primary_size + len(items) > self._threshold:
            capacity = len(self._primary)
            while (capacity >> 1) + (capacity >> 2) < self._primary_size + len(items) \
                    and capacity < MAXIMUM_CAPACITY:
                capacity <<= 1
            self._grow_now(capacity)
        tab = self._primary
        mask = len(tab) - 1
        version = self._version
        size = self._primary_size
        threshold = self._threshold
        for key, namespace, state in items:
            h = hash((key, namespace))
            idx = h & mask
            head = e = tab[idx]
            while e is not None:
                if e.hash == h and e.key == key and e.namespace == namespace:
                    e.state = state
                    e.state_version = version
                    break
                e = e.next
            else:
                tab[idx] = _Entry(key, namespace, state, h, head, version, version)
                size += 1
                if size > threshold and len(tab) < MAXIMUM_CAPACITY:
                    self._primary_size = size
                    self._grow_now(len(tab) << 1)
                    tab = self._primary
                    mask = len(tab) - 1
                    threshold = self._threshold
        self._primary_size = size

    def _grow_now(self, capacity: int) -> None:
        """Grow the bucket array to ``capacity`` (a larger power of two) in one pass (only with
        no snapshot running and no rehash in flight: entries are relinked in place, which a
        snapshot sharing them would see)."""
        old = self._primary
        new: list[_Entry | None] = [None] * capacity
        mask = len(new) - 1
        for head in old:
            e = head
            while e is not None:
                nxt = e.next
                pos = e.hash & mask
                e.next = new[pos]
                new[pos] = e
                e = nxt
        self._primary = new
        self._threshold = (len(new) >> 1) + (len(new) >> 2)

    def remove(self, key: K, namespace: N) -> bool:
        """Remove ``(key, namespace)``; True if it was present."""
        if self._rehash_table:
            self._incremental_rehash()
        h = hash((key, namespace))
        tab = self._primary
        idx = h & (len(tab) - 1)
        if idx < self._rehash_index:
            tab = self._rehash_table
            idx = h & (len(tab) - 1)
        prev: _Entry | None = None
        e = tab[idx]
        while e is not None:
            if e.hash == h and e.key == key and e.namespace == namespace:
                if prev is None:
                    tab[idx] = e.next  # the live array only; snapshots hold their own copy
                else:
                    required = self._highest_required
                    if prev.entry_version < required:
                        prev = self._copy_chain(tab, idx, prev, required)
                    prev.next = e.next
                self._mod_count += 1
                if tab is self._primary:
                    self._primary_size -= 1
                else:
                    self._rehash_size -= 1
                return True
            prev = e
            e = e.next
        return False

    # ------------------------------------------------------------------ snapshots

    def snapshot(self) -> CopyOnWriteStateMapSnapshot[K, N, S]:
        """Freeze the current contents; the map stays writable. Call on the writer thread.

        Returns:
            a snapshot to iterate (on any thread) and then ``release()``.
        """
        with self._versions_lock:
            self._version += 1
            version = self._version
            self._highest_required = version
            self._snapshot_versions.add(version)
        table = self._primary
        if self._rehash_table:
            rh = self._rehash_index
            new = self._rehash_table
            half = len(new) >> 1
            data = table[rh:]
            data += new[:rh]
            data += new[half:half + rh]
        else:
            data = table[:]
        return CopyOnWriteStateMapSnapshot(self, data, version, len(self))

    def sample(self, n: int, max_buckets: int = 4096) -> list[tuple[K, N, S]]:
        """Up to ``n`` entries, the first found in bucket order among at most ``max_buckets``
        buckets: no snapshot and no copy, for size estimates on the writer thread (states are
        shared: read-only)."""
        out: list[tuple[K, N, S]] = []
        for tab in (self._primary, self._rehash_table):
            for i in range(min(len(tab), max_buckets)):  # no slice: stop at the n-th entry
                e = tab[i]
                while e is not None and len(out) < n:
                    out.append((e.key, e.namespace, e.state))
                    e = e.next
                if len(out) >= n:
                    return out
        return out

    def structure_bytes(self) -> int:
        """Bytes of the map's own structure: its bucket arrays and entry objects (not the keys,
        namespaces and states they hold)."""
        return (sys.getsizeof(self._primary) + sys.getsizeof(self._rehash_table)
                + len(self) * _ENTRY_BYTES)

    def entries(self) -> Iterator[tuple[K, N, S]]:
        """Iterate ``(key, namespace, state)`` as of this call.

        Backed by a private snapshot, so the caller may keep reading and writing the map while it
        iterates. States are shared with the map: treat them as read-only (use :meth:`get` for a
        state you will mutate). The snapshot is released when the iterator is exhausted, closed or
        garbage-collected; close an abandoned iterator early to stop copy-on-write costs.
        """
        return _EntriesIterator(self.snapshot())

    @property
    def state_map_version(self) -> int:
        """Current map version (bumped by every snapshot)."""
        return self._version

    @property
    def highest_required_snapshot_version(self) -> int:
        """Highest version of a running snapshot, 0 when none runs."""
        return self._highest_required

    @property
    def snapshot_versions(self) -> frozenset[int]:
        """Versions of the running (unreleased) snapshots."""
        with self._versions_lock:
            return frozenset(self._snapshot_versions)

    @property
    def capacity(self) -> int:
        """Bucket count of the primary table."""
        return len(self._primary)

    @property
    def is_rehashing(self) -> bool:
        """True while an incremental rehash is in progress."""
        return bool(self._rehash_table)

    def check_invariants(self) -> None:
        """Verify bucket placement, sizes and uniqueness (test and debug aid; O(capacity)).

        Raises:
            AssertionError: an invariant does not hold.
        """
        primary, new, rh = self._primary, self._rehash_table, self._rehash_index
        seen: set[tuple[Any, Any]] = set()
        p_count = 0
        for i, head in enumerate(primary):
            e = head
            if i < rh:
                assert e is None, f"primary bucket {i} < rehash_index {rh} is not empty"
            while e is not None:
                assert e.hash & (len(primary) - 1) == i, "entry in the wrong primary bucket"
                assert (e.key, e.namespace) not in seen, "duplicate key"
                seen.add((e.key, e.namespace))
                p_count += 1
                e = e.next
        r_count = 0
        for j, head in enumerate(new):
            e = head
            while e is not None:
                assert e.hash & (len(new) - 1) == j, "entry in the wrong rehash bucket"
                assert (e.hash & (len(primary) - 1)) < rh, "rehash-table entry not yet migrated"
                assert (e.key, e.namespace) not in seen, "duplicate key"
                seen.add((e.key, e.namespace))
                r_count += 1
                e = e.next
        assert p_count == self._primary_size, f"primary size {self._primary_size} != {p_count}"
        assert r_count == self._rehash_size, f"rehash size {self._rehash_size} != {r_count}"
        assert rh == 0 or new, "rehash_index set while not rehashing"
        with self._versions_lock:
            expected = max(self._snapshot_versions) if self._snapshot_versions else 0
            assert self._highest_required == expected, "highest required version is stale"

    # ------------------------------------------------------------------ internals

    def _release(self, version: int) -> None:
        with self._versions_lock:
            self._snapshot_versions.discard(version)
            self._highest_required = (max(self._snapshot_versions)
                                      if self._snapshot_versions else 0)

    def _state_for_caller(self, tab: list[_Entry | None], idx: int, e: _Entry) -> Any:
        """get() of a state a snapshot may share: copy it (and the chain) unless immutable."""
        state = e.state
        required = self._highest_required
        if is_immutable(state):
            if e.entry_version >= required:
                e.state_version = self._version  # exclusive entry: skip this check next time
            return state
        if e.entry_version < required:
            e = self._copy_chain(tab, idx, e, required)
        state = self._copier(state)
        e.state = state
        e.state_version = self._version
        return state

    def _copy_chain(self, tab: list[_Entry | None], idx: int, until: _Entry,
                    required: int) -> _Entry:
        """Copy the shared entries of bucket ``idx`` from its head through ``until``.

        Flink's ``handleChainedEntryCopyOnWrite``: a shared predecessor must be copied because its
        single ``next`` pointer cannot serve both the snapshot and the live chain. Returns the
        live (exclusive) version of ``until``.
        """
        version = self._version
        self._mod_count += 1
        current = tab[idx]
        assert current is not None
        if current.entry_version < required:
            copied = _Entry(current.key, current.namespace, current.state, current.hash,
                            current.next, version, current.state_version)
            tab[idx] = copied
        else:
            copied = current
        while current is not until:
            current = current.next
            assert current is not None, "entry to copy is not in its bucket"
            if current.entry_version < required:
                nxt = _Entry(current.key, current.namespace, current.state, current.hash,
                             current.next, version, current.state_version)
                copied.next = nxt
                copied = nxt
            else:
                copied = current
        return copied

    def _double_capacity(self) -> None:
        capacity = len(self._primary)
        if capacity >= MAXIMUM_CAPACITY:
            return  # cannot grow: chains get longer instead
        new_capacity = capacity << 1
        self._rehash_table = [None] * new_capacity
        self._rehash_index = 0
        # The new threshold applies at once: migration (>= 4 entries per op) finishes long
        # before inserts could pass it, so only one rehash is ever in flight.
        self._threshold = (new_capacity >> 1) + (new_capacity >> 2)

    def _incremental_rehash(self) -> None:
        old = self._primary
        new = self._rehash_table
        old_capacity = len(old)
        new_mask = len(new) - 1
        required = self._highest_required
        version = self._version
        rh = self._rehash_index
        transferred = 0
        self._mod_count += 1
        while transferred < MIN_TRANSFERRED_PER_INCREMENTAL_REHASH:
            e = old[rh]
            while e is not None:
                if e.entry_version < required:
                    # Shared with a snapshot: its `next` must not change, so move a copy.
                    e = _Entry(e.key, e.namespace, e.state, e.hash, e.next, version,
                               e.state_version)
                nxt = e.next
                pos = e.hash & new_mask
                e.next = new[pos]
                new[pos] = e
                e = nxt
                transferred += 1
            old[rh] = None
            rh += 1
            if rh == old_capacity:
                # Done. This round's `transferred` is still counted in _primary_size.
                self._primary = new
                self._rehash_table = _EMPTY_TABLE
                self._primary_size += self._rehash_size
                self._rehash_size = 0
                self._rehash_index = 0
                return
        self._primary_size -= transferred
        self._rehash_size += transferred
        self._rehash_index = rh


class CopyOnWriteStateMapSnapshot(Generic[K, N, S]):
    """The contents of a :class:`CopyOnWriteStateMap` frozen at ``snapshot()``.

    Iterate it (any thread, any number of times) for ``(key, namespace, state)``; states are
    shared with the live map and must be treated as read-only. ``release()`` is idempotent;
    iterating a released snapshot raises :class:`dstl.errors.ClosedError`, also when the release
    happens (on another thread) in the middle of an iteration. Usable as a context manager.
    """

    __slots__ = ("_data", "_owner", "_size", "_version")

    def __init__(self, owner: CopyOnWriteStateMap[K, N, S], data: list[_Entry | None],
                 version: int, size: int) -> None:
        self._owner: CopyOnWriteStateMap[K, N, S] | None = owner
        self._data: list[_Entry | None] | None = data
        self._version = version
        self._size = size

    @property
    def version(self) -> int:
        """The map version this snapshot registered."""
        return self._version

    @property
    def released(self) -> bool:
        return self._data is None

    def __len__(self) -> int:
        """Entries in the snapshot."""
        return self._size

    def __iter__(self) -> Iterator[tuple[K, N, S]]:
        data = self._data
        if data is None:
            raise self._closed()
        for head in data:
            e = head
            if e is None:
                continue
            while e is not None:
                yield e.key, e.namespace, e.state
                e = e.next
            if self._data is None:  # released mid-iteration: entries may be mutated from now on
                raise self._closed()

    def release(self) -> None:
        """Unregister the snapshot so the map stops copying for it. Idempotent, thread-safe."""
        owner = self._owner
        if self._data is None or owner is None:
            return
        self._data = None
        self._owner = None
        owner._release(self._version)

    def __enter__(self) -> CopyOnWriteStateMapSnapshot[K, N, S]:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def _closed(self) -> ClosedError:
        return ClosedError(f"state map snapshot version {self._version}",
                           hint="iterate before release(), or take a new snapshot")


class _EntriesIterator(Generic[K, N, S]):
    """Iterator of :meth:`CopyOnWriteStateMap.entries`: releases its snapshot when exhausted,
    closed or garbage-collected (a generator that never started would never release it)."""

    __slots__ = ("_it", "_snap")

    def __init__(self, snap: CopyOnWriteStateMapSnapshot[K, N, S]) -> None:
        self._snap = snap
        self._it = iter(snap)

    def __iter__(self) -> _EntriesIterator[K, N, S]:
        return self

    def __next__(self) -> tuple[K, N, S]:
        try:
            return next(self._it)
        except StopIteration:
            self._snap.release()
            raise

    def close(self) -> None:
        """Stop iterating and release the snapshot."""
        self._snap.release()

    def __del__(self) -> None:
        self._snap.release()
