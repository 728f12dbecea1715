"""Retry timing for store operations: exponential backoff with full jitter, bounded by a deadline.

Theory of operation
-------------------
Pure (sans-I/O): :class:`RetryBudget` is fed the failures of one operation and the time, and
answers "wait this long, then try again" or "give up". The upload scheduler drives it with its
timer (``dstl/scheduler.py``); :func:`call_with_retries` drives it with a clock and ``sleep`` for
the blob store's reads and deletes (``dstl/stores/fsspec_store.py``). Which failures are
retryable, and which of those are throttling, is decided in one place,
:func:`dstl.stores.base.translate_error`.

- **Throttling** (:class:`~dstl.errors.ThrottledError`: 503 ``SlowDown``, 429, 500
  ``InternalError``, 502/504, ``Throttling`` codes) means the service is overloaded, and a retry
  at once makes it worse. The k-th throttled retry of an operation waits a uniformly random time
  in ``[0, min(backoff_max_s, backoff_base_s * 2**(k-1)))`` — exponential backoff with *full
  jitter*, which spreads the retries of many writers over the whole window instead of
  synchronising them. Throttled attempts do not use up ``max_attempts``: the service asked the
  client to slow down, not to give up; the deadline bounds them.
- **Other transient failures** (connection resets, timeouts, truncated bodies) count against
  ``max_attempts``. They wait ``fixed_delay_s`` when it is set (uploads keep Flink's fixed
  ``upload_retry_delay_s``), otherwise the same jittered exponential backoff, counted separately.
- **Deadline.** No retry starts later than ``deadline_s`` after the first attempt: a backoff that
  would end past it is not waited; the operation gives up at once with the last error. So the
  caller hears of a failure within ``deadline_s`` plus one attempt (whose own length is bounded by
  the client's connect/read timeouts, or for uploads by the scheduler).
- **Attempt names.** Every upload attempt writes its own object name with a two-digit hex
  attempt number, so :data:`MAX_ATTEMPT_NAMES` bounds the attempts of one segment as well.

Randomness and time are injected (``draw`` in ``[0, 1)``, ``now_s``), so tests check exact
delays without sleeping.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from dstl.errors import ConfigError, ThrottledError, TransientStorageError
from dstl.options import DstlOptions

__all__ = ["MAX_ATTEMPT_NAMES", "RetryBudget", "RetryPolicy", "call_with_retries"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Attempts of one segment upload are numbered in two hex digits of its object name.
MAX_ATTEMPT_NAMES = 255


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How one kind of store operation retries (see the module docstring).

    Defaults are those of :class:`~dstl.options.DstlOptions` for reads and deletes; build the
    policies of a storage with :meth:`for_uploads` and :meth:`for_store`.
    """

    #: Attempts for failures other than throttling, the first included.
    max_attempts: int = 3
    #: Ceiling of the first backoff; it doubles with every further retry of the same kind.
    backoff_base_s: float = 0.1
    #: Largest backoff.
    backoff_max_s: float = 5.0
    #: No retry starts later than this after the first attempt.
    deadline_s: float = 30.0
    #: Delay after a non-throttling failure; ``None``: back off as for throttling.
    fixed_delay_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) \
                or self.max_attempts < 1:
            raise ConfigError("max_attempts", self.max_attempts, "an int >= 1",
                              owner="RetryPolicy")
        for name in ("backoff_base_s", "backoff_max_s", "deadline_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(name, value, "a number >= 0", owner="RetryPolicy")
        if self.fixed_delay_s is not None and self.fixed_delay_s < 0:
            raise ConfigError("fixed_delay_s", self.fixed_delay_s, "None or >= 0",
                              owner="RetryPolicy")

    @classmethod
    def for_uploads(cls, o: DstlOptions) -> RetryPolicy:
        """Segment uploads: ``upload_max_attempts``, fixed ``upload_retry_delay_s`` for
        non-throttling failures, jittered backoff for throttling, ``retry_deadline_s``."""
        return cls(max_attempts=o.upload_max_attempts, backoff_base_s=o.retry_backoff_base_s,
                   backoff_max_s=o.retry_backoff_max_s, deadline_s=o.retry_deadline_s,
                   fixed_delay_s=o.upload_retry_delay_s)

    @classmethod
    def for_store(cls, o: DstlOptions) -> RetryPolicy:
        """Reads and deletes of a blob store: ``read_max_attempts``, jittered backoff for every
        retry, ``retry_deadline_s``."""
        return cls(max_attempts=o.read_max_attempts, backoff_base_s=o.retry_backoff_base_s,
                   backoff_max_s=o.retry_backoff_max_s, deadline_s=o.retry_deadline_s)

    def backoff_s(self, retry: int, draw: float) -> float:
        """Full jitter: ``draw * min(backoff_max_s, backoff_base_s * 2**(retry-1))``.

        Args:
            retry: 1 for the first retry of this kind, 2 for the second, ...
            draw: a uniform random number in ``[0, 1)``.
        """
        ceiling = min(self.backoff_max_s, self.backoff_base_s * 2.0 ** min(retry - 1, 60))
        return draw * ceiling


class RetryBudget:
    """The retry state of one operation: feed it failures, it says how long to wait or stop.

    Args:
        policy: the rules.
        started_s: time of the first attempt (same clock as later ``now_s``).
    """

    def __init__(self, policy: RetryPolicy, started_s: float) -> None:
        self.policy = policy
        self.started_s = started_s
        #: Failed attempts that were throttled, and that failed otherwise.
        self.throttled = 0
        self.failed = 0

    @property
    def deadline(self) -> float:
        return self.started_s + self.policy.deadline_s

    def attempts_left(self, started_attempts: int) -> bool:
        """Whether another attempt may start (the attempt limit for non-throttling failures
        and the object-name limit; throttled attempts do not count against the first)."""
        unthrottled = started_attempts - self.throttled
        return unthrottled < self.policy.max_attempts and started_attempts < MAX_ATTEMPT_NAMES

    def after_failure(self, err: BaseException, started_attempts: int, now_s: float,
                      draw: float) -> float | None:
        """Record a failed attempt; return the delay before the next one, or ``None`` to stop.

        Args:
            err: the translated error (a DSTL error; only transient ones are retried).
            started_attempts: attempts started so far (the failed one included).
            now_s: the time now.
            draw: a uniform random number in ``[0, 1)`` for the jitter.
        """
        if not isinstance(err, TransientStorageError):
            return None
        throttled = isinstance(err, ThrottledError)
        if throttled:
            self.throttled += 1
            delay = self.policy.backoff_s(self.throttled, draw)
        else:
            self.failed += 1
            fixed = self.policy.fixed_delay_s
            delay = fixed if fixed is not None else self.policy.backoff_s(self.failed, draw)
        if not self.attempts_left(started_attempts) or now_s + delay > self.deadline:
            return None
        return delay


def call_with_retries(fn: Callable[[], T], policy: RetryPolicy, *, translate: Callable[
        [BaseException], BaseException], what: str,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        draw: Callable[[], float] = random.random) -> T:
    """Run ``fn`` until it returns, retrying transient failures as ``policy`` says.

    Args:
        fn: one attempt.
        policy: the retry rules.
        translate: turns what ``fn`` raised into a DSTL error (the retry decision reads it).
        what: the operation and object, for log lines.
        clock, sleep, draw: time, waiting and jitter (injected by tests).

    Raises:
        The translated error of the last attempt, chained to what ``fn`` raised.
    """
    budget = RetryBudget(policy, clock())
    attempts = 0
    while True:
        attempts += 1
        try:
            return fn()
        except Exception as exc:
            err = translate(exc)
            delay = budget.after_failure(err, attempts, clock(), draw())
            if delay is None:
                if attempts > 1:
                    logger.warning("%s failed after %d attempts (%d throttled, %.2fs): %s",
                                   what, attempts, budget.throttled,
                                   clock() - budget.started_s, err)
                raise err from exc
            logger.debug("%s attempt %d failed (%s); retrying in %.3fs", what, attempts, err,
                          delay)
            sleep(delay)
