"""Batching upload scheduler: one per process, one segment per flush window for all writers.

Theory of operation
-------------------
Writers hand :class:`UploadTask` s (their change sets plus callbacks) to :meth:`BatchingUploadScheduler.upload`:

1. **Throttle.** Queued + uploading bytes are limited by ``max_in_flight_bytes``. A caller whose
   task does not fit waits (back-pressure; a task larger than the whole limit still goes through
   when nothing else is in flight). The wait ends when capacity frees up, when the storage closes
   (``ClosedError``), or after ``back_pressure_timeout_s`` (``UploadTimeoutError``). Time spent
   waiting is the ``backPressureTimeSeconds`` metric; :meth:`available` / :meth:`wait_available`
   are the availability signal.
2. **Batch.** The task joins the queue. The queue is drained into ONE segment when
   ``persist_delay_s`` has passed since the first queued task, or at once when the queued bytes
   reach ``persist_size_threshold_bytes`` (or the delay is 0).
3. **Upload with retries** (:class:`_SegmentUpload`). The segment is encoded once. Each attempt
   writes a fresh object name. An attempt that is still running after ``upload_timeout_s`` does
   not stop: a concurrent attempt starts at once, and the first to finish wins; the objects of
   the losers, and of failed attempts that may have landed anyway, are deleted. A retryable I/O
   error starts the next attempt after ``upload_retry_delay_s``; throttling (503 ``SlowDown``,
   429, 500 ``InternalError``) after an exponentially growing backoff with full jitter, without
   using up an attempt (:mod:`dstl.retry`); a non-retryable error fails the segment at once.
   After ``upload_max_attempts`` attempts not spent on throttling (the last one timed out or
   failed), or at the latest ``retry_deadline_s`` after the first attempt, every task of the
   segment fails with :class:`~dstl.errors.UploadFailedError` carrying the attempt count and the
   cause. So an upload ends, one way or the other, within about
   ``min(upload_max_attempts * (upload_timeout_s + upload_retry_delay_s), retry_deadline_s)``
   without throttling, and within ``retry_deadline_s`` with it.
4. **Register, then acknowledge.** The winning segment is tracked in the registry (one reference
   per change set) *before* any writer hears of it, then each task's ``on_success`` receives the
   references of its change sets. A change set is therefore acknowledged only after its segment
   is durably stored (G1) and exactly one object holds it (G6).

:class:`UploadScheduler` is what a storage and its writers need of a scheduler; this module's
:class:`BatchingUploadScheduler` is one, the Spark executor agent's client adapter
(``dstl.spark``'s ``AgentUploadScheduler``, which hands tasks to the agent's batching scheduler)
is the other.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from dstl.errors import (
    ClosedError,
    DstlError,
    TransientStorageError,
    UploadFailedError,
    UploadTimeoutError,
)
from dstl.handle import ChangeSetRef
from dstl.layout import segment_key
from dstl.metrics import MetricsRegistry
from dstl.options import DstlOptions
from dstl.registry import SegmentRegistry
from dstl.retry import RetryBudget, RetryPolicy
from dstl.segment import ChangeSet, IndexEntry, encode_segment
from dstl.stores.base import BlobStore, translate_error
from dstl.timer import Timer, TimerHandle

__all__ = ["BatchingUploadScheduler", "UploadScheduler", "UploadTask"]

logger = logging.getLogger(__name__)

SuccessCallback = Callable[[list[tuple[ChangeSet, ChangeSetRef]]], None]
FailureCallback = Callable[[list[ChangeSet], BaseException], None]


@dataclass(slots=True)
class UploadTask:
    """Change sets of one writer to upload, with the writer's callbacks (run on upload threads)."""

    change_sets: list[ChangeSet]
    on_success: SuccessCallback
    on_failure: FailureCallback
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = sum(cs.size for cs in self.change_sets)


class UploadScheduler(Protocol):
    """What :class:`~dstl.ChangelogStorage` and its writers need of an upload scheduler
    (``ChangelogStorage(uploader=...)`` takes any).

    A scheduler resolves every task it accepted exactly once: ``task.on_success`` with the
    references of all its change sets after they are durably stored, or ``task.on_failure``.
    Callbacks may run on any thread.
    """

    def upload(self, task: UploadTask) -> None:
        """Accept ``task`` (an empty one is ignored); may block for capacity (back-pressure).

        Raises:
            ClosedError: the scheduler is closed.
            UploadTimeoutError: no capacity in time.
        """

    def available(self) -> bool:
        """True when a new task would not block."""

    def wait_available(self, timeout_s: float | None = None) -> bool:
        """Block until :meth:`available` (or closed, or the timeout); return availability."""

    def close(self, timeout_s: float | None = None) -> None:
        """Stop accepting tasks; resolve (or fail) those accepted, within a bound."""


class BatchingUploadScheduler:
    """Gathers upload tasks of all writers of a storage into one segment per flush window."""

    def __init__(self, store: BlobStore, registry: SegmentRegistry, options: DstlOptions,
                 timer: Timer, metrics: MetricsRegistry, storage_id: str, *,
                 draw: Callable[[], float] = random.random) -> None:
        self._store = store
        self._registry = registry
        self._opts = options
        self._policy = RetryPolicy.for_uploads(options)
        self._draw = draw  # the jitter's random numbers in [0, 1) (tests inject them)
        self._timer = timer
        self._storage_id = storage_id
        self._pool = ThreadPoolExecutor(options.upload_threads, thread_name_prefix="dstl-upload")
        self._cond = threading.Condition()
        self._queue: list[UploadTask] = []
        self._queued_bytes = 0
        self._in_flight_bytes = 0
        self._drain_timer: TimerHandle | None = None
        self._uploads: set[_SegmentUpload] = set()
        self._upload_no = 0
        self._closed = False
        m = metrics
        self.m_requests = m.counter("numberOfUploadRequests")
        self.m_failures = m.counter("numberOfUploadFailures")
        self.m_failed_segments = m.counter("numberOfFailedSegments")
        self.m_segments = m.counter("numberOfSegments")
        self.m_bytes = m.counter("uploadedBytes")
        self.m_sizes = m.histogram("uploadSizes")
        self.m_latency = m.histogram("uploadLatenciesSeconds")
        self.m_attempts = m.histogram("attemptsPerUpload")
        self.m_total_attempts = m.histogram("totalAttemptsPerUpload")
        self.m_batch = m.histogram("uploadBatchSizes")
        self.m_writers = m.histogram("writersPerSegment")
        self.m_busy = m.counter("backPressureTimeSeconds")
        m.gauge("uploadQueueSize", lambda: float(len(self._queue)))
        m.gauge("inFlightBytes", lambda: float(self._in_flight_bytes))

    # ------------------------------------------------------------------ submission

    def upload(self, task: UploadTask) -> None:
        """Queue ``task``; may block for capacity (see the module docstring).

        Raises:
            ClosedError: the storage closed (also while waiting).
            UploadTimeoutError: no capacity within ``back_pressure_timeout_s``.
        """
        if not task.change_sets:
            return
        drain = False
        with self._cond:
            self._throttle(task.size)
            self._in_flight_bytes += task.size
            self._queue.append(task)
            self._queued_bytes += task.size
            if (self._opts.persist_delay_s == 0
                    or self._queued_bytes >= self._opts.persist_size_threshold_bytes):
                drain = True
            elif self._drain_timer is None:
                self._drain_timer = self._timer.schedule(self._opts.persist_delay_s,
                                                         self._drain)
        if drain:
            self._drain()

    def _throttle(self, size: int) -> None:
        limit = self._opts.max_in_flight_bytes

        def blocked() -> bool:
            return self._in_flight_bytes > 0 and self._in_flight_bytes + size > limit

        if self._closed:
            raise ClosedError("changelog storage", "the storage was closed")
        if not blocked():
            return
        t0 = time.monotonic()
        deadline = t0 + self._opts.back_pressure_timeout_s
        try:
            while blocked():
                if self._closed:
                    raise ClosedError("changelog storage", "closed while waiting for upload "
                                                           "capacity")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise UploadTimeoutError(
                        f"no upload capacity for {size} bytes within back_pressure_timeout_s="
                        f"{self._opts.back_pressure_timeout_s}s ({self._in_flight_bytes} bytes "
                        f"in flight, max_in_flight_bytes={limit}); uploads are too slow or "
                        "stuck — check the store, or raise max_in_flight_bytes")
                self._cond.wait(remaining)
        finally:
            self.m_busy.inc(time.monotonic() - t0)

    def available(self) -> bool:
        """True when a new task would not block (no back-pressure right now)."""
        with self._cond:
            return self._in_flight_bytes < self._opts.max_in_flight_bytes

    def wait_available(self, timeout_s: float | None = None) -> bool:
        """Block until :meth:`available` (or closed, or the timeout); return availability."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._closed or self._in_flight_bytes < self._opts.max_in_flight_bytes,
                timeout_s) and not self._closed

    def flush(self) -> None:
        """Drain the queue now instead of waiting for the persist delay."""
        self._drain()

    def _drain(self) -> None:
        with self._cond:
            if self._drain_timer is not None:
                self._drain_timer.cancel()
                self._drain_timer = None
            tasks, self._queue = self._queue, []
            self._queued_bytes = 0
            if not tasks:
                return
            ups = []
            for group in _segment_groups(tasks):
                self._upload_no += 1
                ups.append(_SegmentUpload(self, group, self._upload_no))
            self._uploads.update(ups)
        for up in ups:
            up.run_step(up.start)

    def _finished(self, up: _SegmentUpload) -> None:
        with self._cond:
            self._uploads.discard(up)
            self._in_flight_bytes -= up.size
            self._cond.notify_all()

    # ------------------------------------------------------------------ lifecycle

    def close(self, timeout_s: float | None = None) -> None:
        """Send what is queued, wait (bounded) for running uploads, stop the upload threads.

        Uploads still unfinished after the bound fail their tasks with ``ClosedError``. The
        default bound is the longest an upload can take (it gives up at ``retry_deadline_s``).
        """
        if timeout_s is None:
            timeout_s = self._opts.retry_deadline_s + 1.0
        self._drain()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._uploads and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            stuck = list(self._uploads)
        for up in stuck:
            up.abandon(ClosedError("changelog storage", f"closed while segment upload "
                                                        f"#{up.upload_no} was still running"))
        self._pool.shutdown(wait=not stuck, cancel_futures=True)
        if stuck:
            logger.warning("closed with %d segment uploads still running; their threads finish "
                           "in the background and their objects are orphans", len(stuck))


def _segment_groups(tasks: Sequence[UploadTask]) -> list[list[UploadTask]]:
    """The queued tasks in order, cut into segments so that no segment holds a change set
    ``(log id, sqn)`` twice (a writer closed with an upload queued and a new writer of the same
    log id in the same window); decoders refuse such a segment."""
    groups: list[list[UploadTask]] = []
    seen: set[tuple[str, int]] = set()
    for t in tasks:
        ids = {(cs.log_id, cs.sqn) for cs in t.change_sets}
        if not groups or ids & seen:
            groups.append([])
            seen = set()
        groups[-1].append(t)
        seen |= ids
    return groups


class _SegmentUpload:
    """One segment: encode once, attempts with timeouts and retries, first success wins."""

    def __init__(self, sched: BatchingUploadScheduler, tasks: Sequence[UploadTask],
                 upload_no: int) -> None:
        self.s = sched
        self.tasks = list(tasks)
        self.upload_no = upload_no
        self.change_sets = [cs for t in self.tasks for cs in t.change_sets]
        self.size = sum(t.size for t in self.tasks)
        self.created_ms = int(time.time() * 1000)
        self._lock = threading.Lock()
        self._encoded: tuple[bytes, list[IndexEntry]] | None = None
        self._attempts = 0
        self._running: dict[int, TimerHandle | None] = {}
        self._timed_out: set[int] = set()
        self._done = False
        self._resolved = False  # the tasks' callbacks were (or are being) called
        self._last_error: BaseException | None = None
        self._t0 = time.monotonic()
        self._budget = RetryBudget(sched._policy, sched._timer.now())
        self._deadline_timer: TimerHandle | None = None

    def start(self) -> None:
        self.s.m_batch.update(len(self.tasks))
        self._deadline_timer = self.s._timer.schedule(self.s._policy.deadline_s,
                                                      self._guarded(self._on_deadline))
        self._start_attempt()

    def run_step(self, step: Callable[[], None]) -> None:
        """Run one step of this upload (on the caller's, a timer's or an upload thread).

        Whatever the step raises fails the upload's tasks with a typed error, unless they are
        resolved already: a step that dies must never leave a persist future unresolved (the
        timer thread and the pool only log, or keep, what a callback raises).
        """
        try:
            step()
        except BaseException as exc:
            self._crash(exc)
            if not isinstance(exc, Exception):
                raise

    def _guarded(self, step: Callable[[], None]) -> Callable[[], None]:
        """``step`` wrapped by :meth:`run_step`, for the timer and the pool."""
        return lambda: self.run_step(step)

    def _crash(self, exc: BaseException) -> None:
        with self._lock:
            self._done = True
        failure = UploadFailedError(
            f"segment upload #{self.upload_no} to {self.s._store.location} failed internally "
            f"after {self._attempts} attempt(s): {type(exc).__name__}: {exc} (the change sets "
            "are not acknowledged; the writer fails and restores from its last checkpoint)",
            attempts=self._attempts, elapsed_s=time.monotonic() - self._t0)
        failure.__cause__ = exc
        if not self._fail(failure):
            logger.exception("segment upload #%d: a step failed after its tasks were resolved",
                             self.upload_no, exc_info=exc)

    def _on_deadline(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            err = self._last_error
        failure = UploadFailedError(
            f"segment upload #{self.upload_no} to {self.s._store.location}: no attempt succeeded "
            f"within retry_deadline_s={self.s._policy.deadline_s}s ({self._attempts} attempts, "
            f"{self._budget.throttled} throttled); last error: {err}; check the store, or raise "
            "retry_deadline_s", attempts=self._attempts, elapsed_s=time.monotonic() - self._t0)
        failure.__cause__ = err
        self._fail(failure)

    def _start_attempt(self) -> None:
        with self._lock:
            if self._done:
                return
            self._attempts += 1
            n = self._attempts
            self._running[n] = None
        key = segment_key(self.created_ms, self.s._storage_id, self.upload_no, n)
        handle = self.s._timer.schedule(self.s._opts.upload_timeout_s,
                                        self._guarded(lambda: self._on_timeout(n)))
        with self._lock:
            if n in self._running:
                self._running[n] = handle
        self.s.m_requests.inc()
        try:
            self.s._pool.submit(self.run_step, lambda: self._attempt(n, key))
        except RuntimeError as exc:  # pool shut down (storage closed)
            handle.cancel()
            self._attempt_failed(n, key, ClosedError("changelog storage", str(exc)))

    def _encode(self) -> bytes:
        with self._lock:
            if self._encoded is None:
                data, entries = encode_segment(
                    self.change_sets, self.s._opts.zstd_level,
                    max_change_set_bytes=self.s._opts.max_change_set_bytes)
                self._encoded = (data, list(entries))
            return self._encoded[0]

    def _attempt(self, n: int, key: str) -> None:
        t0 = time.monotonic()
        try:
            data = self._encode()
            self.s._store.put(key, data)
        except BaseException as exc:  # noqa: BLE001 - every failure is this attempt's outcome
            self._attempt_failed(n, key, exc)
            return
        self._attempt_succeeded(n, key, len(data), time.monotonic() - t0)

    def _stop_timer(self, n: int) -> None:
        handle = self._running.pop(n, None)
        if handle is not None:
            handle.cancel()

    def _still_in_time(self) -> bool:
        """Whether some running attempt has not yet used up its timeout (caller holds _lock)."""
        return bool(set(self._running) - self._timed_out)

    def _on_timeout(self, n: int) -> None:
        with self._lock:
            if self._done or n not in self._running:
                return
            self._timed_out.add(n)
            more = (self._budget.attempts_left(self._attempts)
                    and self.s._timer.now() < self._budget.deadline)
            # Out of attempts: give up once no running attempt is within its timeout (the
            # late ones may still finish; they are then discarded as losers).
            give_up = not more and not self._still_in_time()
            if give_up:
                self._done = True
        if more:
            logger.info("segment upload #%d attempt %d still running after %.3fs; starting a "
                        "concurrent attempt", self.upload_no, n, self.s._opts.upload_timeout_s)
            self._start_attempt()
        elif give_up:
            self._fail(UploadFailedError(
                f"segment upload #{self.upload_no} to {self.s._store.location}: all "
                f"{self._attempts} attempts timed out or failed (upload_timeout_s="
                f"{self.s._opts.upload_timeout_s}s; raise upload_timeout_s or "
                "upload_max_attempts, or check the store)",
                attempts=self._attempts, elapsed_s=time.monotonic() - self._t0))

    def _attempt_failed(self, n: int, key: str, exc: BaseException) -> None:
        err = translate_error(exc, op="put", key=key, location=self.s._store.location) \
            if not isinstance(exc, DstlError) else exc
        retryable = isinstance(err, TransientStorageError)
        self.s.m_failures.inc()
        if retryable:
            # The write may have landed although the client saw an error ("ghost success"):
            # delete the name so it cannot linger; nothing refers to it.
            self.s._registry.discard_untracked(key)
        with self._lock:
            self._stop_timer(n)
            if self._done:
                return
            self._last_error = err
            delay = self._budget.after_failure(err, self._attempts, self.s._timer.now(),
                                               self.s._draw())
            more = delay is not None
            give_up = not more and (not retryable or not self._still_in_time())
            if give_up:
                self._done = True
        logger.warning("segment upload #%d attempt %d to %s failed (%s)%s", self.upload_no, n,
                       key, err, f"; retrying in {delay:.3f}s" if delay is not None else "")
        if delay == 0:
            self._start_attempt()
        elif delay is not None:
            self.s._timer.schedule(delay, self._guarded(self._start_attempt))
        elif give_up:
            self._give_up(err, key, retryable)

    def _give_up(self, err: BaseException, key: str, retryable: bool) -> None:
        o = self.s._opts
        what = "failed with a non-retryable error" if not retryable else (
            f"all failed ({self._budget.throttled} throttled; upload_max_attempts="
            f"{o.upload_max_attempts}, retry_deadline_s={o.retry_deadline_s}s)")
        failure = UploadFailedError(
            f"segment upload #{self.upload_no} to {self.s._store.location}: {self._attempts} "
            f"attempt(s) {what}; last error: {err}", key=key, attempts=self._attempts,
            elapsed_s=time.monotonic() - self._t0)
        failure.__cause__ = err
        self._fail(failure)

    def _attempt_succeeded(self, n: int, key: str, nbytes: int, latency_s: float) -> None:
        with self._lock:
            self._stop_timer(n)
            lost = self._done
            self._done = True
            total_attempts = self._attempts
            entries = self._encoded[1] if self._encoded else []
        if lost:
            logger.info("segment upload #%d attempt %d finished after another outcome; "
                        "deleting %s", self.upload_no, n, key)
            self.s._registry.discard_untracked(key)
            return
        self._cancel_deadline()
        s = self.s
        s._registry.start_tracking(key, len(self.change_sets))
        s.m_segments.inc()
        s.m_bytes.inc(nbytes)
        s.m_sizes.update(nbytes)
        s.m_latency.update(latency_s)
        s.m_attempts.update(n)
        s.m_total_attempts.update(total_attempts)
        s.m_writers.update(len({cs.log_id for cs in self.change_sets}))
        logger.debug("segment %s written: %d change sets of %d tasks, %d bytes, attempt %d, "
                     "%.1f ms", key, len(self.change_sets), len(self.tasks), nbytes, n,
                     latency_s * 1e3)
        i = 0
        results: list[list[tuple[ChangeSet, ChangeSetRef]]] = []
        for t in self.tasks:
            pairs = []
            for cs in t.change_sets:
                e = entries[i]
                i += 1
                pairs.append((cs, ChangeSetRef(cs.sqn, key, e.offset, e.length, cs.change_count,
                                               cs.payload_bytes, cs.kg_min, cs.kg_max)))
            results.append(pairs)
        if not self._claim_resolution():
            return
        s._finished(self)
        for t, pairs in zip(self.tasks, results):
            _call(t.on_success, pairs)

    def _claim_resolution(self) -> bool:
        """True for the one caller that may resolve the tasks (success or failure)."""
        with self._lock:
            if self._resolved:
                return False
            self._resolved = True
            return True

    def _fail(self, err: BaseException) -> bool:
        """Fail every task with ``err``; False if the tasks were resolved already."""
        self._cancel_deadline()
        if not self._claim_resolution():
            return False
        self.s.m_failed_segments.inc()
        self.s._finished(self)
        for t in self.tasks:
            _call(t.on_failure, t.change_sets, err)
        return True

    def _cancel_deadline(self) -> None:
        handle = self._deadline_timer
        if handle is not None:
            handle.cancel()

    def abandon(self, err: BaseException) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._fail(err)


def _call(fn: Callable[..., None], *args: object) -> None:
    try:
        fn(*args)
    except Exception:
        logger.exception("upload callback %r raised (a DSTL bug)", fn)

