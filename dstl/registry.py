"""TM-side segment registry: who may delete an uploaded segment, and when.

Theory of operation
-------------------
A segment holds change sets of many writers. Until a checkpoint that refers to it completes, only
this process knows the segment exists, so only this process can delete it (Flink's
``TaskChangelogRegistry``, FLINK-25511/FLINK-28440). Each tracked segment has:

- ``refs``: change sets in it still held by a writer (starts at the segment's change-set count;
  one release per change set on truncate, truncate-and-close, or a late upload result that
  arrives after its range was truncated);
- ``pins``: in-flight checkpoints whose handles name it (taken by ``persist`` for a checkpoint id,
  dropped on confirm or reset). Flink releases without pinning, so a materialization plus a
  subsumption could delete a segment that a not-yet-completed checkpoint names (apache/flink#27599);
  here a pinned segment is never deleted.

A segment is deleted — on the discard thread, never the caller's — exactly when it is still tracked
and ``refs == 0 and pins == 0``. ``stop_tracking`` (called by ``confirm``) hands the segment over to
the checkpoint coordinator: the TM forgets it and never deletes it.

Invariants: refs and pins never go below zero (an extra release is logged, not applied); a
segment is deleted at most once; nothing pinned or referenced is deleted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass

from dstl.metrics import MetricsRegistry
from dstl.stores.base import BlobStore

__all__ = ["SegmentRegistry"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Entry:
    refs: int
    pins: int = 0


class SegmentRegistry:
    """Reference counts and pins of segments this process uploaded and still owns.

    Args:
        store: where deletes go.
        discard: executor that runs deletes (never the caller's thread).
        metrics: registry for ``numberOfDiscardedSegments`` and friends.
    """

    def __init__(self, store: BlobStore, discard: Executor, metrics: MetricsRegistry,
                 on_delete_error: Callable[[str, BaseException], None] | None = None) -> None:
        self._store = store
        self._discard = discard
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._deleted = metrics.counter("numberOfDiscardedSegments")
        self._delete_failures = metrics.counter("numberOfDiscardFailures")
        self._on_delete_error = on_delete_error
        #: False when segments are shared beyond this process's writers (the executor agent's
        #: segments): then nothing is tracked or deleted here; the coordinator owns deletion.
        self.deletes_enabled = True
        metrics.gauge("trackedSegments", lambda: float(len(self._entries)))

    def start_tracking(self, key: str, ref_count: int) -> None:
        """Track a just-uploaded segment holding ``ref_count`` change sets (must be > 0)."""
        if ref_count <= 0:
            raise ValueError(f"segment {key} tracked with ref_count={ref_count}; must be > 0")
        if not self.deletes_enabled:
            return
        with self._lock:
            if key in self._entries:
                raise ValueError(f"segment {key} is already tracked")
            self._entries[key] = _Entry(ref_count)

    def release(self, key: str, n: int = 1) -> None:
        """Drop ``n`` change-set references; delete the segment if nothing holds it any more."""
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                # Normal after stop_tracking (the coordinator owns it now).
                logger.debug("release of untracked segment %s ignored", key)
                return
            if n > e.refs:
                logger.warning("segment %s released %d times but held only %d references; "
                               "clamping (a DSTL bug)", key, n, e.refs)
                n = e.refs
            e.refs -= n
            doomed = e.refs == 0 and e.pins == 0
            if doomed:
                del self._entries[key]
        if doomed:
            self._schedule_delete(key)

    def pin(self, keys: Iterable[str]) -> list[str]:
        """Pin tracked segments for an in-flight checkpoint; returns those actually pinned."""
        pinned = []
        with self._lock:
            for key in keys:
                e = self._entries.get(key)
                if e is not None:
                    e.pins += 1
                    pinned.append(key)
        return pinned

    def unpin(self, keys: Iterable[str]) -> None:
        """Undo :meth:`pin` (once per key pinned); may delete segments that became unused."""
        doomed = []
        with self._lock:
            for key in keys:
                e = self._entries.get(key)
                if e is None:
                    continue  # handed over meanwhile
                if e.pins == 0:
                    logger.warning("segment %s unpinned more often than pinned (a DSTL bug)", key)
                    continue
                e.pins -= 1
                if e.refs == 0 and e.pins == 0:
                    del self._entries[key]
                    doomed.append(key)
        for key in doomed:
            self._schedule_delete(key)

    def stop_tracking(self, key: str) -> None:
        """Hand the segment over to the checkpoint coordinator: never delete it from here."""
        with self._lock:
            self._entries.pop(key, None)

    def tracked(self) -> dict[str, tuple[int, int]]:
        """``{key: (refs, pins)}`` of tracked segments (for tests and the CLI)."""
        with self._lock:
            return {k: (e.refs, e.pins) for k, e in self._entries.items()}

    def discard_untracked(self, key: str) -> None:
        """Delete an object this registry never tracked (a losing upload attempt)."""
        self._schedule_delete(key)

    def _schedule_delete(self, key: str) -> None:
        try:
            self._discard.submit(self._delete, key)
        except RuntimeError:
            # Executor already shut down (storage closing): delete inline rather than leak.
            self._delete(key)

    def _delete(self, key: str) -> None:
        try:
            self._store.delete([key])
            self._deleted.inc()
            logger.debug("discarded segment %s", key)
        except Exception as exc:  # noqa: BLE001 - any failure leaves an orphan; counted, logged
            self._delete_failures.inc()
            logger.warning("could not delete unused segment %s (%s); it stays as an orphan for "
                           "`dstl gc` to collect", key, exc)
            if self._on_delete_error is not None:
                self._on_delete_error(key, exc)
