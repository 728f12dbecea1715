"""``MaterializationManager``: the runtime around one backend's :class:`~materializer.policy.
MaterializationPolicy` — the timer, the materializer thread, the guards and the materialized
base that checkpoints build on.

Theory of operation
-------------------
- **Base.** :class:`MaterializedBase` is what the next checkpoint of the backend references:
  the snapshot objects, the sequence number they reach (``up_to``), the restored log after them
  (until the first materialization) and the newest materialization id. It is immutable and
  replaced as a whole (by a finished materialization, a restore, or a snapshot made elsewhere),
  so a checkpoint reads a consistent one without a lock.
- **Attempt.** :meth:`MaterializationManager.start`: the boundary is the source's log end; the
  owner thread takes the table snapshot (short: heap maps are versioned, LMDB opens a read
  transaction, see :class:`SnapshotSource`) and the ``dstl-materializer`` thread writes and
  uploads it while the owner keeps writing; its end replaces the base and records the outcome
  in the policy.
- **Guards** (Flink's): at most one attempt at a time, and none until the previous snapshot was
  confirmed by a completed checkpoint (:meth:`confirm`) or failed — a checkpoint must never
  reference a snapshot whose shared state a later one replaced. An LMDB table never starts one
  inside an open write batch (its read transaction would miss the batch's uncommitted writes
  although the log already holds them): deferred until the batch ends.
- **Who triggers.** *Automatic* (a plain backend): the timer fires at the policy's due time, the
  size trigger fires from :meth:`note_log` (called for every logged change); both only raise a
  flag through ``wake`` — the heap table has a single writer — and the owner starts the attempt
  at its next state access or checkpoint (:meth:`attend`). A triggered attempt that finds nothing
  new or a guard in its way stays pending, without moving the schedule: it starts at the first
  new change, or when the guard lifts. *Polled* (``automatic=False``; the Spark task): no timer
  and no flags; the owner asks :meth:`due` and calls :meth:`run_now`.
- **Failures.** A failed attempt is counted by the policy; one more than ``max_failures`` in a
  row fails the manager for good: :meth:`attend` and :meth:`run_now` raise
  :class:`~dstl.errors.BackendFailedError` chained to the cause from then on.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from dstl.errors import BackendFailedError, ClosedError
from dstl.handle import ChangelogHandle
from dstl.metrics import MetricsRegistry
from dstl.timer import ThreadTimer, Timer, TimerHandle
from materializer.handles import SnapshotRef
from materializer.policy import MaterializationPolicy, MaterializationRules, Uniform

__all__ = ["MaterializationManager", "MaterializedBase", "SnapshotSource"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MaterializedBase:
    """What the next checkpoint builds on (see the module docstring).

    Attributes:
        snapshots: the materialized snapshot objects.
        up_to: the backend's log is materialized below this sequence number.
        restored_log: restored change sets after the snapshots (until the first
            materialization; they keep being referenced, as in Flink).
        materialization_id: id of the newest snapshot (0: none).
    """

    snapshots: tuple[SnapshotRef, ...] = ()
    up_to: int = 0
    restored_log: tuple[ChangelogHandle, ...] = ()
    materialization_id: int = 0


class SnapshotSource(Protocol):
    """What the manager needs from its backend."""

    def log_end(self) -> int:
        """The boundary of a materialization starting now (everything logged so far is
        below it)."""

    def take_snapshot(self, materialization_id: int, up_to: int
                      ) -> Callable[[], tuple[SnapshotRef, ...]]:
        """On the owner thread: snapshot the table as of ``up_to``; return the job that writes
        and uploads it (run on the materializer thread) and gives the pieces of the new base:
        a full snapshot alone, or the current base's pieces followed by a delta."""

    def base_changed(self) -> None:
        """A new base is in place (the backend may truncate its log)."""


class MaterializationManager:
    """Runs the materializations of one backend (see the module docstring).

    Args:
        name: the backend's operator id (in log lines and errors).
        rules: the policy's settings.
        source: the backend side.
        metrics: the backend's registry (Flink's materialization metric names go there).
        wake: raises the owner's attention flag (automatic mode).
        timer: timer of the time trigger (default: a thread of its own when ``automatic`` and
            an interval is set); also the clock.
        automatic: trigger by timer and size (``False``: polled, see the module docstring).
        defer_in_batch: an attempt waits for the end of an open write batch (LMDB).
        uniform: random source of the first delay.
    """

    def __init__(self, name: str, rules: MaterializationRules, source: SnapshotSource,
                 metrics: MetricsRegistry, *, wake: Callable[[], None],
                 timer: Timer | None = None, automatic: bool = True,
                 defer_in_batch: bool = False, uniform: Uniform = random.uniform) -> None:
        self.name = name
        self._source = source
        self._wake = wake
        self._automatic = automatic
        self._defer_in_batch = defer_in_batch
        self._lock = threading.Lock()
        self._policy = MaterializationPolicy(rules, uniform=uniform, boundary=0)
        self._base = MaterializedBase()
        self._next_id = 1
        self._confirmed_id = 0  # newest materialization named by a completed checkpoint
        self._failed_id = 0     # newest materialization that failed
        self._running = False
        self._current: Future[None] | None = None
        self._failure: BaseException | None = None
        self._closed = False
        self._requested = False  # the timer fired (or a start was deferred); none started yet
        self._batch_depth = 0
        self.log_bytes = 0       # data-record bytes logged since the last snapshot
        self._trigger_at = rules.size_threshold(0) if automatic else math.inf
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="dstl-materializer")
        self._own_timer = automatic and timer is None and rules.interval_s is not None
        self._timer = (ThreadTimer(f"materializer-{name}") if self._own_timer
                       else timer if automatic else None)
        self._clock: Callable[[], float] = timer.now if timer is not None else time.monotonic
        self._timer_handle: TimerHandle | None = None
        self._register_metrics(metrics)
        self._policy.start(self._clock())
        self._arm()

    def _register_metrics(self, m: MetricsRegistry) -> None:
        self._m_started = m.counter("startedMaterialization")
        self._m_completed = m.counter("completedMaterialization")
        self._m_failed = m.counter("failedMaterialization")
        self._last_duration_ms = -1.0
        self._last_size = 0.0
        self._last_inc_size = 0.0
        m.gauge("lastDurationOfMaterialization", lambda: self._last_duration_ms)
        m.gauge("lastFullSizeOfMaterialization", lambda: self._last_size)
        m.gauge("lastIncSizeOfMaterialization", lambda: self._last_inc_size)
        m.gauge("logBytesSinceMaterialization", lambda: float(self.log_bytes))

    # ------------------------------------------------------------------ state

    @property
    def base(self) -> MaterializedBase:
        """What the next checkpoint builds on (replaced as a whole, read without a lock)."""
        return self._base

    @property
    def current(self) -> Future[None] | None:
        """The newest attempt's future (done once it ended), ``None`` before the first."""
        return self._current

    @property
    def consecutive_failures(self) -> int:
        return self._policy.consecutive_failures

    def due(self) -> bool:
        """Whether an attempt is due now (polled mode's question; the guards aside)."""
        with self._lock:
            return self._requested or self._policy.due(self._clock(), self.log_bytes)

    # ------------------------------------------------------------------ triggers

    def note_log(self, nbytes: int) -> None:
        """``nbytes`` of data records were logged (hot path: one comparison). Wakes the owner
        when the size trigger fires, or when a pending attempt found nothing new before."""
        self.log_bytes += nbytes
        if self.log_bytes > self._trigger_at:
            self._trigger_at = math.inf  # once; attend() re-arms it
            self._wake()

    def timer_fired(self) -> None:
        """The time trigger (the timer's callback; tests call it to fire the timer)."""
        self._requested = True
        self._wake()

    def attend(self) -> None:
        """On the owner thread, when its flag was raised: report a failure, or start the
        pending attempt.

        Raises:
            BackendFailedError: too many consecutive failures (every call from now on).
            ClosedError: the manager is closed.
        """
        self._raise_if_failed()
        if self._closed:
            self._wake()
            raise ClosedError(f"backend {self.name!r}")
        if self._requested or self._policy.size_due(self.log_bytes):
            self.start()
        else:
            self._rearm_size_trigger()

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            self._wake()
            raise BackendFailedError(
                f"backend {self.name!r} failed: materialization failed "
                f"{self._policy.consecutive_failures} times in a row (max_failures="
                f"{self._policy.rules.max_failures}); restore it from its last completed "
                "checkpoint") from self._failure

    # ------------------------------------------------------------------ attempts

    def run_now(self, timeout_s: float | None = None) -> SnapshotRef | None:
        """Run one attempt to completion (the timer's ``run_once``).

        Returns:
            The new snapshot (a full one or a delta: the newest piece of the base), or ``None``
            when none started (nothing new, a guard, or deferred to the end of the write
            batch).

        Raises:
            BackendFailedError: failed for good (earlier, or by this attempt).
            Exception: this attempt's own failure (it is counted).
        """
        self._raise_if_failed()
        fut = self.start()
        if fut is None:
            return None
        fut.result(timeout_s)
        snapshots = self._base.snapshots
        return snapshots[-1] if snapshots else None

    def start(self) -> Future[None] | None:
        """Start an attempt now unless a guard, nothing new or an open write batch holds it
        back (then a triggered one stays pending); owner thread."""
        if self._batch_depth and self._defer_in_batch:
            self._requested = True  # batch_closed() wakes the owner
            return None
        with self._lock:
            if self._blocked_locked():
                self._trigger_at = math.inf  # the guard lifting re-arms the triggers
                return None
        up_to = self._source.log_end()
        with self._lock:
            if not self._policy.has_new(up_to):
                if self._requested and self._automatic:  # pending until the next change
                    self._trigger_at = self.log_bytes
                return None
            mat_id, self._next_id = self._next_id, self._next_id + 1
            self._requested = False
            self._running = True
        self._m_started.inc()
        try:
            write = self._source.take_snapshot(mat_id, up_to)
        except BaseException:
            with self._lock:
                self._running = False
            raise
        log_bytes, self.log_bytes = self.log_bytes, 0
        self._rearm_size_trigger()
        fut = self._executor.submit(self._run, write, mat_id, up_to, log_bytes, time.monotonic())
        self._current = fut
        return fut

    def _blocked_locked(self) -> bool:
        newest = self._base.materialization_id
        unconfirmed = newest > self._confirmed_id and newest > self._failed_id
        if self._running or unconfirmed:
            logger.debug("backend %s: materialization skipped (%s)", self.name,
                         "one in flight" if self._running else "previous not yet confirmed")
            return True
        return False

    def _run(self, write: Callable[[], tuple[SnapshotRef, ...]], mat_id: int, up_to: int,
             log_bytes: int, t0: float) -> None:
        try:
            pieces = write()
        except BaseException as exc:
            self.log_bytes += log_bytes  # still not materialized
            self._failed(mat_id, exc)
            raise
        self._finished(pieces, up_to, time.monotonic() - t0)

    def _finished(self, pieces: tuple[SnapshotRef, ...], up_to: int, duration_s: float) -> None:
        ref = pieces[-1]
        # the size trigger compares the log with what a restore reads: every piece
        full = sum(p.size for p in pieces)
        with self._lock:
            self._base = MaterializedBase(pieces, up_to, (), ref.materialization_id)
            self._policy.record_success(self._clock(), up_to, full)
            self._running = False
            self._requested = False  # a time trigger that fired meanwhile is stale (rule 2)
            self._rearm_size_trigger_locked()
        self._m_completed.inc()
        self._last_duration_ms = duration_s * 1000.0
        self._last_size = float(full)
        self._last_inc_size = float(ref.size)
        logger.info("backend %s: materialization %d up to sqn %d written to %s (%s, %d bytes; "
                    "%d pieces, %d bytes; %.1f ms)", self.name, ref.materialization_id, up_to,
                    ref.key, "delta" if ref.delta else "full", ref.size, len(pieces), full,
                    duration_s * 1e3)
        self._source.base_changed()
        self._arm()

    def _failed(self, mat_id: int, exc: BaseException) -> None:
        self._m_failed.inc()
        with self._lock:
            self._failed_id = max(self._failed_id, mat_id)
            fatal = self._policy.record_failure(self._clock())
            self._running = False
            self._requested = False
            if fatal:
                self._failure = exc
            else:
                self._rearm_size_trigger_locked()
        logger.warning("backend %s: materialization %d failed (%d in a row): %s", self.name,
                       mat_id, self._policy.consecutive_failures, exc)
        self._arm()  # failed for good: cancels the timer
        if fatal:
            self._wake()
        else:
            self._resume_pending()

    # ------------------------------------------------------------------ guard events

    def confirm(self, materialization_id: int) -> None:
        """A completed checkpoint referenced this materialization: the next may start."""
        with self._lock:
            self._confirmed_id = max(self._confirmed_id, materialization_id)
            self._rearm_size_trigger_locked()
        self._resume_pending()

    def _resume_pending(self) -> None:
        if self._automatic and (self._requested or self._policy.size_due(self.log_bytes)):
            self._wake()

    def _rearm_size_trigger(self) -> None:
        with self._lock:
            self._rearm_size_trigger_locked()

    def _rearm_size_trigger_locked(self) -> None:
        if self._automatic:
            self._trigger_at = self._policy.size_threshold

    def batch_opened(self) -> None:
        self._batch_depth += 1

    def batch_closed(self) -> None:
        self._batch_depth -= 1
        if self._batch_depth == 0 and self._requested:
            self._wake()

    # ------------------------------------------------------------------ bases made elsewhere

    def restored(self, base: MaterializedBase) -> None:
        """A restore's base: part of a completed checkpoint (so confirmed); its snapshot size
        is not known."""
        with self._lock:
            self._base = base
            self._next_id = base.materialization_id + 1
            self._confirmed_id = base.materialization_id
            self._policy.record_snapshot(base.up_to)

    def install(self, cut: Callable[[MaterializedBase], MaterializedBase | None]
                ) -> MaterializedBase | None:
        """Replace the base with ``cut(base)`` — one snapshot made elsewhere and what is left
        of the log after it — unless ``cut`` gives ``None``; returns the new base."""
        with self._lock:
            new = cut(self._base)
            if new is None:
                return None
            self._base = new
            self._next_id = max(self._next_id, new.materialization_id + 1)
            size = sum(r.size for r in new.snapshots)
            self._policy.record_snapshot(new.up_to, size)
            self.log_bytes = 0
            self._rearm_size_trigger_locked()
        self._m_completed.inc()
        self._last_size = self._last_inc_size = float(size)
        self._source.base_changed()
        return new

    def next_materialization_id(self) -> int:
        """The id the next snapshot of this backend gets at least."""
        return self._next_id

    # ------------------------------------------------------------------ timer, close

    def _arm(self) -> None:
        with self._lock:
            if self._timer is None or self._closed:
                return
            delay = self._policy.delay(self._clock())
            if self._timer_handle is not None:
                self._timer_handle.cancel()
            self._timer_handle = (None if delay is None
                                  else self._timer.schedule(delay, self.timer_fired))

    def close(self) -> None:
        """Stop the timer and wait for a running attempt. Idempotent."""
        with self._lock:
            self._closed = True
            if self._timer_handle is not None:
                self._timer_handle.cancel()
        if self._own_timer and self._timer is not None:
            self._timer.close()
        self._executor.shutdown(wait=True)
