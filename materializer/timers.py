"""Timers as keyed DSTL state: registered per key, found by time per key group.

Theory of operation
-------------------
A timer is ``(timestamp_ms, key)``; a key holds a set of timestamps (registering one twice is
one timer). Two states of the key's backend hold them, both in the key's key group, so they are
logged, checkpointed, restored and moved by a rescale exactly like every other state:

- ``$timers`` — a value state of the key: its timestamps, sorted (``list_timers``; cheap
  membership for ``delete_timer``);
- ``$timer_index`` — a *raw* state (:meth:`~materializer.backend.ChangelogKeyedStateBackend.
  register_raw_state`): one entry per timer at the key's key group, key = the timestamp as 8
  order-preserving big-endian bytes (``ts + 2**63``), namespace = the key's bytes, value = the
  user's key (safe codec; e.g. an integer key keyed by its decimal string comes back as the
  integer).

**Finding the due timers** never scans the keys. In LMDB a key group's entries of one state are
one key range sorted by key bytes, and every index key has the same length, so the index is in
``(timestamp, key bytes)`` order on disk: one cursor seek per key group and a scan that stops at
the first timer not due (:meth:`LmdbStateTable.entries_up_to`). The heap table is a hash map, so
the service keeps a binary heap of ``(timestamp, key bytes, key group)`` in memory, built from
the index entries on first use (after a restore: from what the restore loaded) and updated by
every register; deletions are lazy (a popped timer counts only if its index entry still
exists; ``due`` puts the live ones back), and the heap is rebuilt when stale entries outnumber
live ones.

**Firing** (:meth:`TimerService.due`, then :meth:`TimerService.consume` per timer with the key
current): the due list is taken once, before any handler runs, so a timer registered while
timers fire waits for the next round even if it is already due (no unbounded loops), and a due
timer that a handler deleted first is skipped. ``consume`` deletes the timer (logged) before
its handler runs, as Flink does: a handler that lists its key's timers does not see the one
firing, and re-registering it makes a new timer.
"""

from __future__ import annotations

import bisect
import heapq
import struct
from dataclasses import dataclass
from typing import Any, Final

from dstl.errors import UsageError
from materializer.backend import ChangelogKeyedStateBackend
from materializer.codecs import SafeCodec
from materializer.states import ValueStateDescriptor

__all__ = [
    "MAX_TIMESTAMP_MS",
    "MIN_TIMESTAMP_MS",
    "TIMERS_STATE",
    "TIMER_INDEX_STATE",
    "DueTimer",
    "TimerService",
    "check_timestamp",
    "decode_timestamp",
    "encode_timestamp",
]

#: The per-key state (sorted timestamps) and the per-key-group time index.
TIMERS_STATE: Final = "$timers"
TIMER_INDEX_STATE: Final = "$timer_index"
#: Timestamps are signed 64-bit milliseconds.
MIN_TIMESTAMP_MS: Final = -(1 << 63)
MAX_TIMESTAMP_MS: Final = (1 << 63) - 1
_TS: Final = struct.Struct(">Q")
_BIAS: Final = 1 << 63
_TS_LEN: Final = _TS.size
#: Heap index: rebuild once this many stale entries exceed the live ones.
_COMPACT_MIN_STALE: Final = 1024


def encode_timestamp(ts: int) -> bytes:
    """8 bytes whose byte order is the numeric order of ``ts`` (negative ones included)."""
    return _TS.pack(ts + _BIAS)


def decode_timestamp(data: bytes) -> int:
    return int(_TS.unpack(data)[0]) - _BIAS


def check_timestamp(ts: object, what: str = "timer timestamp") -> int:
    """``ts`` as an int of epoch milliseconds in the signed 64-bit range.

    Raises:
        UsageError: not an int (bools and floats refused: a float loses milliseconds), or out
            of range.
    """
    if not isinstance(ts, int) or isinstance(ts, bool):
        raise UsageError(f"{what} {ts!r} must be an int of epoch milliseconds, not "
                         f"{type(ts).__name__} (e.g. int(dt.timestamp() * 1000))")
    if not MIN_TIMESTAMP_MS <= ts <= MAX_TIMESTAMP_MS:
        raise UsageError(f"{what} {ts} is outside the signed 64-bit millisecond range")
    return ts


@dataclass(frozen=True, order=True)
class DueTimer:
    """A timer that is due: fire it with its key current (:meth:`TimerService.consume`)."""

    timestamp_ms: int
    key_bytes: bytes
    key_group: int
    key: Any  # the key as registered (compared last: never needed for the order)


class TimerService:
    """The timers of one backend (see the module docstring). Register, delete and list act on
    the backend's current key."""

    def __init__(self, backend: ChangelogKeyedStateBackend) -> None:
        self._b = backend
        self._per_key = backend.get_state(ValueStateDescriptor(TIMERS_STATE))
        self._sid = backend.register_raw_state(TIMER_INDEX_STATE)
        self._codec = SafeCodec()
        self._lmdb = backend.table_kind == "lmdb"
        self._heap: list[tuple[int, bytes, int]] | None = None  # heap table: built on first use
        self._stale = 0

    def register(self, ts: int, key: Any) -> bool:
        """Register a timer at ``ts`` for the current key (``key``: the key as the caller
        knows it, given back when the timer fires); ``False`` if it existed already."""
        ts = check_timestamp(ts)
        timers = self.list_timers()
        i = bisect.bisect_left(timers, ts)
        if i < len(timers) and timers[i] == ts:
            return False
        timers.insert(i, ts)
        self._per_key.update(timers)
        kb, kg = self._b.current_key_bytes, self._b.current_key_group
        self._b.raw_put(self._sid, kg, encode_timestamp(ts), kb, self._codec.encode(key))
        if self._heap is not None:
            heapq.heappush(self._heap, (ts, kb, kg))
        return True

    def delete(self, ts: int) -> bool:
        """Delete the current key's timer at ``ts``; ``False`` if there was none."""
        ts = check_timestamp(ts)
        timers = self.list_timers()
        i = bisect.bisect_left(timers, ts)
        if i == len(timers) or timers[i] != ts:
            return False
        del timers[i]
        self._per_key.update(timers or None)  # None clears: no empty lists kept
        self._b.raw_remove(self._sid, self._b.current_key_group, encode_timestamp(ts),
                           self._b.current_key_bytes)
        self._stale += 1
        return True

    def list_timers(self) -> list[int]:
        """The current key's timers, ascending."""
        return list(self._per_key.value() or ())

    def due(self, up_to_ms: int) -> list[DueTimer]:
        """Every timer with ``timestamp <= up_to_ms``, in ``(timestamp, key bytes)`` order."""
        up_to_ms = check_timestamp(up_to_ms, "time")
        if self._lmdb:
            return self._due_lmdb(up_to_ms)
        return self._due_heap(up_to_ms)

    def consume(self, timer: DueTimer) -> bool:
        """Delete ``timer`` before its handler runs; ``False``: it is gone already (a handler
        deleted it). Its key must be current.

        Raises:
            UsageError: another key is current.
        """
        if self._b.current_key_bytes != timer.key_bytes:
            raise UsageError(f"timer of key {timer.key!r} consumed with another current key")
        return self.delete(timer.timestamp_ms)

    # ------------------------------------------------------------------ the indexes

    def _due_lmdb(self, up_to_ms: int) -> list[DueTimer]:
        table = self._b.tables
        bound = encode_timestamp(up_to_ms)
        out = []
        for kg in self._b.key_groups:
            for k, ns, v in table.entries_up_to(self._sid, kg, _TS_LEN, bound):
                out.append(DueTimer(decode_timestamp(k), ns, kg, self._codec.decode(v)))
        out.sort(key=lambda t: (t.timestamp_ms, t.key_bytes))
        return out

    def _build_heap(self) -> list[tuple[int, bytes, int]]:
        heap = [(decode_timestamp(k), ns, kg) for kg in self._b.key_groups
                for k, ns, _ in self._b.raw_entries(self._sid, kg)]
        heapq.heapify(heap)
        self._stale = 0
        return heap

    def _due_heap(self, up_to_ms: int) -> list[DueTimer]:
        heap = self._heap
        if heap is None or (self._stale > _COMPACT_MIN_STALE and self._stale > len(heap) // 2):
            heap = self._heap = self._build_heap()
        out: list[DueTimer] = []
        live: list[tuple[int, bytes, int]] = []
        while heap and heap[0][0] <= up_to_ms:
            entry = heapq.heappop(heap)
            ts, kb, kg = entry
            v = self._b.raw_get(self._sid, kg, encode_timestamp(ts), kb)
            if v is None:  # deleted: the lazy deletion ends here
                self._stale = max(0, self._stale - 1)
                continue
            if live and live[-1] == entry:  # pushed twice (registered, deleted, registered)
                continue
            live.append(entry)
            out.append(DueTimer(ts, kb, kg, self._codec.decode(v)))
        for entry in live:  # due() does not consume: consume() deletes (lazily here)
            heapq.heappush(heap, entry)
        return out
