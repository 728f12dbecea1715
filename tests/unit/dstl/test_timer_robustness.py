"""No timer failure leaves a future unresolved.

Before: a delay beyond ``threading.TIMEOUT_MAX`` (``persist_delay_s=1e10``, an upload timeout or
retry delay of that size) raised ``OverflowError`` inside ``Condition.wait`` on the timer thread
and killed it, so every later delay, timeout and retry of the storage never ran and persist
futures never resolved; and a step of a segment upload that raised on the timer thread or an
upload thread was only logged (or kept in a future nobody reads), leaving its tasks — and the
writers' persist futures — pending forever, with their bytes counted as in flight.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import pytest
from support.fakes import ScriptedStore

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import DstlError, UploadFailedError, UsageError
from dstl.timer import ManualTimer, ThreadTimer, TimerHandle

KGS = KeyGroupRange(0, 7)
WAIT = 10.0


# ----------------------------------------------------------------- the timer thread


@pytest.mark.parametrize("far", [1e10, 1e300, math.inf])
def test_thread_timer_outlives_a_delay_beyond_the_platform_limit(far: float) -> None:
    timer = ThreadTimer("far")
    try:
        never = timer.schedule(far, lambda: None)
        fired = threading.Event()
        timer.schedule(0.01, fired.set)
        assert fired.wait(WAIT), "the timer thread died on the far deadline"
        assert timer._thread.is_alive()
        never.cancel()
    finally:
        timer.close()


def test_thread_timer_goes_on_after_a_callback_raises() -> None:
    timer = ThreadTimer("raise")
    try:
        def boom() -> None:
            raise RuntimeError("callback bug")

        timer.schedule(0.0, boom)
        fired = threading.Event()
        timer.schedule(0.01, fired.set)
        assert fired.wait(WAIT)
    finally:
        timer.close()


@pytest.mark.parametrize("make", [lambda: ThreadTimer("nan"), ManualTimer])
@pytest.mark.parametrize("bad", [math.nan, "1", None])
def test_a_delay_that_is_not_a_number_is_refused(make: Callable[[], ThreadTimer | ManualTimer],
                                                 bad: object) -> None:
    timer = make()
    try:
        with pytest.raises(UsageError, match="timer delay"):
            timer.schedule(bad, lambda: None)  # type: ignore[arg-type]
    finally:
        timer.close()


# ----------------------------------------------------------------- steps of an upload


class FailingTimer(ManualTimer):
    """A manual timer whose ``schedule`` raises for the delays in ``fail_delays`` (a broken
    timer wrapper, or any bug in a step that schedules the next one)."""

    def __init__(self, fail_delays: set[float]) -> None:
        super().__init__()
        self.fail_delays = fail_delays

    def schedule(self, delay_s: float, fn: Callable[[], None]) -> TimerHandle:
        if delay_s in self.fail_delays:
            raise RuntimeError(f"cannot schedule {delay_s}")
        return super().schedule(delay_s, fn)


def _storage(store: ScriptedStore, timer: ManualTimer, **kw: object) -> ChangelogStorage:
    base: dict[str, object] = dict(persist_delay_s=0.25, upload_timeout_s=1.0,
                                   upload_retry_delay_s=0.5, upload_max_attempts=3)
    base.update(kw)
    return ChangelogStorage(store=store, options=DstlOptions(**base),  # type: ignore[arg-type]
                            timer=timer)


def _assert_failed_typed(storage: ChangelogStorage, future: object) -> None:
    exc = future.exception(WAIT)  # type: ignore[attr-defined]
    assert isinstance(exc, DstlError), f"expected a typed failure, got {exc!r}"
    assert isinstance(exc, UploadFailedError) or isinstance(exc.__cause__, UploadFailedError)
    assert "RuntimeError" in str(exc) or "RuntimeError" in str(exc.__cause__)
    assert storage.metrics()["ChangelogStorage.inFlightBytes"] == 0  # capacity given back


def test_a_step_failing_on_the_timer_thread_fails_the_persist(store: ScriptedStore) -> None:
    timer = FailingTimer({1.0})  # the drain runs, then scheduling the attempt timeout fails
    with _storage(store, timer) as s:
        w = s.create_writer("w", KGS)
        w.append(1, b"x")
        fut = w.persist(0, 1)
        timer.advance(0.25)  # the persist delay: the drain runs on the timer
        _assert_failed_typed(s, fut)
        timer.fail_delays.clear()  # the storage stays usable for other writers
        w2 = s.create_writer("w2", KGS)
        w2.append(1, b"y")
        fut2 = w2.persist(0, 2)
        timer.advance(0.25)
        assert fut2.result(WAIT).to_sqn == 1


def test_a_step_failing_on_the_callers_thread_fails_the_persist(store: ScriptedStore) -> None:
    timer = FailingTimer({1.0})
    with _storage(store, timer, persist_delay_s=0.0) as s:  # the drain runs in persist()
        w = s.create_writer("w", KGS)
        w.append(1, b"x")
        fut = w.persist(0, 1)
        _assert_failed_typed(s, fut)


def test_a_step_failing_on_an_upload_thread_fails_the_persist() -> None:
    store = ScriptedStore(["transient"])
    timer = FailingTimer({0.5})  # the attempt fails; scheduling its retry fails too
    with _storage(store, timer) as s:
        w = s.create_writer("w", KGS)
        w.append(1, b"x")
        fut = w.persist(0, 1)
        timer.advance(0.25)
        _assert_failed_typed(s, fut)


def test_a_retry_step_failing_on_the_timer_thread_fails_the_persist() -> None:
    store = ScriptedStore(["transient"])
    timer = FailingTimer(set())
    with _storage(store, timer) as s:
        w = s.create_writer("w", KGS)
        w.append(1, b"x")
        fut = w.persist(0, 1)
        timer.advance(0.25)
        timer.wait_for_pending(0.5)  # the retry is scheduled; its attempt timeout cannot be
        timer.fail_delays.add(1.0)
        timer.advance(0.5)
        _assert_failed_typed(s, fut)


@pytest.fixture
def store() -> ScriptedStore:
    return ScriptedStore()
