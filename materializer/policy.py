"""When the next materialization is due: one pure policy for every place that materializes.

Three runtimes materialize a state table: the backend's own manager (a timer thread, or the
state accesses of its owner), the Spark task (once per batch, before its checkpoint) and the
executor agent's materializer (one thread for the executor's LMDB partitions). They differ in
*where* they look at the schedule; *what* is due is decided here, by a
:class:`MaterializationPolicy` per table. It does no I/O, starts no thread and reads no clock:
its owner feeds it values and ``now`` (seconds of the owner's monotonic clock) and asks.

Rules
-----
Settings: :class:`MaterializationRules` (from :class:`~materializer.options.BackendOptions`,
``docs/configuration.md``): ``interval_s``, ``log_ratio``, ``min_log_bytes``, ``max_failures``.

1. **First due time.** :meth:`~MaterializationPolicy.start` at ``now``: due at ``now + u``, ``u``
   drawn from the injected uniform source in ``[0, interval_s)`` — tables opened together do
   not all materialize together (Flink, FLINK-26306). ``interval_s == 0``: due at once;
   ``None``: never due by time.
2. **Fixed delay.** Each *attempt* — a materialization that started, whether it wrote a
   snapshot, failed, or found nothing to write — makes the next one due ``interval_s`` after it
   ended (``0``: due at every check).
3. **Size trigger.** Due, whatever the time, once the log written since the last snapshot
   exceeds ``max(min_log_bytes, log_ratio x last snapshot bytes)`` (``log_ratio None``: off).
   Before a snapshot size is known the threshold is ``min_log_bytes``.
4. **Nothing new: no attempt.** A table whose log end (its *boundary*) equals the boundary of
   its last snapshot is not materialized; being due does not start anything and does not move
   the schedule: the table stays due and runs as soon as something new arrives. The same holds
   while the owner's guard holds it back (one still in flight, or not yet confirmed by a
   checkpoint): waiting is not an attempt.
5. **Failures.** Consecutive failed attempts are counted; a success resets the count. More
   than ``max_failures`` in a row and the table has *failed*: it is never due again (its owner
   reports the failure; Flink fails the backend).
6. **Snapshots made elsewhere** (installed, or restored) set the last snapshot's boundary and
   size without touching the schedule or the failure count.

What the boundary is belongs to the owner: a sequence number for the backend, a
``(segment key, offset)`` for the agent; the policy only compares boundaries for equality.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from materializer.options import BackendOptions

__all__ = ["MaterializationPolicy", "MaterializationRules", "Uniform"]

#: ``uniform(a, b)``: a number in ``[a, b)`` (``random.uniform``; tests inject their own).
Uniform = Callable[[float, float], float]


@dataclass(frozen=True, slots=True)
class MaterializationRules:
    """The settings of the policy (validated where they are configured: ``BackendOptions``).

    Attributes:
        interval_s: fixed delay between attempts; first due time random in ``[0, interval_s)``;
            ``0``: due at every check; ``None``: never due by time.
        log_ratio: size trigger: log since the last snapshot vs that snapshot's size
            (``None``: off).
        min_log_bytes: the size trigger never fires for less log than this.
        max_failures: consecutive failures tolerated; one more and the table has failed.
    """

    interval_s: float | None
    log_ratio: float | None
    min_log_bytes: int
    max_failures: int

    @classmethod
    def of(cls, options: BackendOptions) -> MaterializationRules:
        return cls(options.materialization_interval_s, options.materialize_log_ratio,
                   options.materialize_min_log_bytes, options.max_failures)

    def size_threshold(self, snapshot_bytes: int) -> float:
        """Log bytes beyond which the size trigger fires, for a last snapshot of this size."""
        if self.log_ratio is None:
            return math.inf
        return max(float(self.min_log_bytes), self.log_ratio * snapshot_bytes)


class MaterializationPolicy:
    """The schedule, size trigger and failure count of one table (rules: module docstring).

    Args:
        rules: the settings; the attribute may be replaced later (a partition re-registered
            with other settings); the schedule already computed stays.
        uniform: random source of the first delay (default :func:`random.uniform`).
        boundary: boundary of the snapshot the table starts from (``None``: none known).

    Attributes:
        next_due: when the next attempt is due by time (``math.inf``: never; before
            :meth:`start`: never).
        boundary: boundary of the last snapshot (``None``: none).
        snapshot_bytes: size of the last snapshot (``0``: not known).
        consecutive_failures: failed attempts since the last success.
    """

    def __init__(self, rules: MaterializationRules, *, uniform: Uniform = random.uniform,
                 boundary: Hashable | None = None) -> None:
        self.rules = rules
        self._uniform = uniform
        self.next_due = math.inf
        self.boundary: Hashable | None = boundary
        self.snapshot_bytes = 0
        self.consecutive_failures = 0

    # ------------------------------------------------------------------ schedule (rules 1, 2)

    def start(self, now: float) -> float:
        """Schedule the first attempt (rule 1); returns its due time."""
        interval = self.rules.interval_s
        if interval is None:
            self.next_due = math.inf
        elif interval <= 0:
            self.next_due = now
        else:
            # clamp: uniform(a, b) may return b itself through rounding
            self.next_due = now + min(max(self._uniform(0.0, interval), 0.0), interval)
        return self.next_due

    def delay(self, now: float) -> float | None:
        """Seconds from ``now`` until due by time (``0`` when already due; ``None``: never)."""
        if self.has_failed or math.isinf(self.next_due):
            return None
        return max(0.0, self.next_due - now)

    def request(self, now: float) -> None:
        """Make the table due by time now (an explicit request: the timer's ``run_once``)."""
        self.next_due = min(self.next_due, now)

    def _after_attempt(self, now: float) -> None:
        interval = self.rules.interval_s
        self.next_due = math.inf if interval is None else now + interval

    # ------------------------------------------------------------------ due (rules 3, 4)

    @property
    def size_threshold(self) -> float:
        """Log bytes since the last snapshot beyond which the size trigger fires (rule 3)."""
        return self.rules.size_threshold(self.snapshot_bytes)

    def size_due(self, log_bytes: float, snapshot_bytes: int | None = None) -> bool:
        """Whether ``log_bytes`` since the last snapshot fire the size trigger.

        ``snapshot_bytes``: the size of the snapshot the log is counted from, when the owner
        measures from another one than the last recorded here (the executor agent counts the log
        of the worker's checkpoint, which starts at the snapshot that checkpoint references).
        """
        size = self.snapshot_bytes if snapshot_bytes is None else snapshot_bytes
        return log_bytes > self.rules.size_threshold(size)

    def due_at(self, log_bytes: float, snapshot_bytes: int | None = None) -> float:
        """When the table is due given ``log_bytes`` since its last snapshot (``-inf``: the
        size trigger says now; ``inf``: never, or failed)."""
        if self.has_failed:
            return math.inf
        return -math.inf if self.size_due(log_bytes, snapshot_bytes) else self.next_due

    def due(self, now: float, log_bytes: float, snapshot_bytes: int | None = None) -> bool:
        """Whether an attempt is due at ``now`` (by time or size; never once failed)."""
        return not self.has_failed and now >= self.due_at(log_bytes, snapshot_bytes)

    def has_new(self, boundary: Hashable | None) -> bool:
        """Whether a log ending at ``boundary`` holds anything the last snapshot does not
        (rule 4; ``None``: no log at all)."""
        return boundary is not None and boundary != self.boundary

    def should_start(self, now: float, log_bytes: float, boundary: Hashable | None,
                     snapshot_bytes: int | None = None) -> bool:
        """Due and something new: an attempt should start now (the owner's guard aside)."""
        return self.due(now, log_bytes, snapshot_bytes) and self.has_new(boundary)

    # ------------------------------------------------------------------ outcomes (rules 2, 5, 6)

    def record_success(self, now: float, boundary: Hashable, snapshot_bytes: int) -> None:
        """An attempt that ended at ``now`` wrote a snapshot of the log up to ``boundary``."""
        self.consecutive_failures = 0
        self.record_snapshot(boundary, snapshot_bytes)
        self._after_attempt(now)

    def record_failure(self, now: float) -> bool:
        """An attempt that ended at ``now`` failed; returns whether the table has now failed
        for good (more than ``max_failures`` in a row)."""
        self.consecutive_failures += 1
        self._after_attempt(now)
        return self.has_failed

    def record_empty(self, now: float) -> None:
        """An attempt that ended at ``now`` found nothing to write (not a failure)."""
        self._after_attempt(now)

    def record_snapshot(self, boundary: Hashable, snapshot_bytes: int | None = None) -> None:
        """A snapshot made elsewhere (installed or restored) is now the table's last one
        (``snapshot_bytes None``: size not known, the previous one stays)."""
        self.boundary = boundary
        if snapshot_bytes is not None:
            self.snapshot_bytes = snapshot_bytes

    @property
    def has_failed(self) -> bool:
        """More than ``max_failures`` consecutive failures: never due again (rule 5)."""
        return self.consecutive_failures > self.rules.max_failures
