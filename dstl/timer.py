"""Timers: delayed callbacks on one background thread, or driven by hand in tests.

The batching scheduler (persist delay) and the retrying uploader (attempt timeouts, retry delays)
need "run this in t seconds unless cancelled". :class:`ThreadTimer` does it with one daemon thread
per storage; :class:`ManualTimer` fires callbacks only when a test calls :meth:`ManualTimer.advance`,
so tests of delays and timeouts are deterministic and never sleep (Flink's
``ManuallyTriggeredScheduledExecutorService``).

Robustness: the timer thread must outlive anything scheduled on it, since every delay, timeout
and retry of its storage runs there — a dead timer thread leaves futures that never resolve.

- A delay is a number (:func:`_deadline`); a negative one means "now", and NaN — a caller's bug
  that ``max(0, nan)`` would silently turn into "now" — is refused.
- The thread never waits longer than :data:`MAX_WAIT_S` at a time: a far deadline (``inf``, or
  a delay beyond ``threading.TIMEOUT_MAX``) is reached by waking up and waiting again, instead of
  an ``OverflowError`` in ``Condition.wait`` that would end the thread.
- A callback that raises is logged and the thread goes on. Callbacks that own futures catch
  their own failures and fail those futures (the upload scheduler does), because only they know
  which futures a failure affects.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

from dstl.checks import check_protocol
from dstl.errors import UsageError

__all__ = ["ManualTimer", "ThreadTimer", "Timer", "TimerHandle", "check_timer"]

logger = logging.getLogger(__name__)

#: Longest single wait of the timer thread (far below ``threading.TIMEOUT_MAX`` everywhere).
MAX_WAIT_S = 3600.0


class TimerHandle:
    """A scheduled callback; ``cancel()`` is idempotent and safe from any thread."""

    __slots__ = ("cancelled", "deadline", "fn")

    def __init__(self, deadline: float, fn: Callable[[], None]) -> None:
        self.deadline = deadline
        self.fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Timer(Protocol):
    def schedule(self, delay_s: float, fn: Callable[[], None]) -> TimerHandle: ...

    def now(self) -> float: ...

    def close(self) -> None: ...


def check_timer(value: Any, field: str, owner: str) -> Timer | None:
    """``value`` if it is ``None`` or has the :class:`Timer` methods.

    Raises:
        ConfigTypeError: it has not.
    """
    if value is None:
        return None
    return cast(Timer, check_protocol(value, field, owner, ("schedule", "now", "close"),
                                      "None or a dstl.timer.Timer (ThreadTimer, ManualTimer)"))


def _deadline(now: float, delay_s: float) -> float:
    """The deadline of a callback due ``delay_s`` after ``now``.

    Raises:
        UsageError: ``delay_s`` is not a number, or NaN.
    """
    if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)) or math.isnan(delay_s):
        raise UsageError(f"timer delay must be a number of seconds, got {delay_s!r}")
    return now + max(0.0, float(delay_s))


def _run(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:
        # A timer callback must not kill the timer thread; callbacks report their own failures
        # through futures, so reaching this is a DSTL bug worth a loud log line.
        logger.exception("timer callback %r raised", fn)


class ThreadTimer:
    """Runs callbacks on one daemon thread named ``dstl-timer-<name>``."""

    def __init__(self, name: str = "storage") -> None:
        self._heap: list[tuple[float, int, TimerHandle]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"dstl-timer-{name}", daemon=True)
        self._thread.start()

    def now(self) -> float:
        return time.monotonic()

    def schedule(self, delay_s: float, fn: Callable[[], None]) -> TimerHandle:
        h = TimerHandle(_deadline(self.now(), delay_s), fn)
        with self._cond:
            if self._closed:
                h.cancel()
                return h
            heapq.heappush(self._heap, (h.deadline, next(self._seq), h))
            self._cond.notify()
        return h

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    if self._heap:
                        wait = self._heap[0][0] - self.now()
                        if wait <= 0:
                            _, _, h = heapq.heappop(self._heap)
                            break
                        # bounded: a far deadline is reached by waiting again, never by
                        # one wait too long for the platform (OverflowError kills the thread)
                        self._cond.wait(min(wait, MAX_WAIT_S))
                    else:
                        self._cond.wait()
            if not h.cancelled:
                _run(h.fn)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()


class ManualTimer:
    """A timer whose clock only moves when :meth:`advance` is called (tests)."""

    def __init__(self) -> None:
        self._now = 0.0
        self._heap: list[tuple[float, int, TimerHandle]] = []
        self._seq = itertools.count()
        self._lock = threading.Condition()

    def now(self) -> float:
        return self._now

    def schedule(self, delay_s: float, fn: Callable[[], None]) -> TimerHandle:
        h = TimerHandle(_deadline(self._now, delay_s), fn)
        with self._lock:
            heapq.heappush(self._heap, (h.deadline, next(self._seq), h))
            self._lock.notify_all()
        return h

    def pending(self) -> list[float]:
        """Delays (from now) of callbacks not yet run or cancelled."""
        with self._lock:
            return self._pending()

    def _pending(self) -> list[float]:
        return sorted(d - self._now for d, _, h in self._heap if not h.cancelled)

    def wait_for_pending(self, delay_s: float, timeout_s: float = 10.0) -> None:
        """Block until a callback due in ``delay_s`` is scheduled (other threads schedule them).

        Raises:
            TimeoutError: none appeared within ``timeout_s`` (real time).
        """
        with self._lock:
            if not self._lock.wait_for(
                    lambda: any(abs(p - delay_s) < 1e-9 for p in self._pending()), timeout_s):
                raise TimeoutError(f"no timer callback due in {delay_s}s was scheduled; "
                                   f"pending: {self._pending()}")

    def advance(self, delta_s: float) -> None:
        """Move the clock forward, running due callbacks in deadline order on this thread."""
        target = self._now + delta_s
        while True:
            with self._lock:
                if not self._heap or self._heap[0][0] > target:
                    break
                deadline, _, h = heapq.heappop(self._heap)
            self._now = max(self._now, deadline)
            if not h.cancelled:
                _run(h.fn)
        self._now = target

    def close(self) -> None:
        with self._lock:
            self._heap.clear()
