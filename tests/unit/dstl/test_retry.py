"""Retry timing (``dstl/retry.py``) and how the upload scheduler and the blob store apply it:
exponential backoff with full jitter on throttling, the attempt limit for other failures, the
deadline. Clocks, sleeps and random draws are injected: nothing here sleeps."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from support.fakes import ScriptedStore

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import (
    ConfigError,
    ObjectNotFoundError,
    ThrottledError,
    TransientStorageError,
    UploadFailedError,
)
from dstl.retry import MAX_ATTEMPT_NAMES, RetryBudget, RetryPolicy, call_with_retries
from dstl.timer import ManualTimer

KGS = KeyGroupRange(0, 7)
WAIT = 10.0
SLOW_DOWN = ThrottledError("put k: SlowDown", key="k")
RESET = TransientStorageError("put k: connection reset", key="k")


# --------------------------------------------------------------------------- the pure part


def test_backoff_is_full_jitter_over_a_doubling_capped_ceiling() -> None:
    p = RetryPolicy(backoff_base_s=0.1, backoff_max_s=1.0)
    assert [p.backoff_s(k, 0.999999) for k in range(1, 7)] == pytest.approx(
        [0.1, 0.2, 0.4, 0.8, 1.0, 1.0], rel=1e-5)
    assert [p.backoff_s(k, 0.5) for k in (1, 2, 3)] == pytest.approx([0.05, 0.1, 0.2])
    assert p.backoff_s(1, 0.0) == 0.0  # full jitter: the whole window, down to zero
    assert p.backoff_s(10_000, 0.5) == pytest.approx(0.5)  # no overflow for huge counts


def test_throttled_failures_do_not_use_up_attempts_but_the_deadline_bounds_them() -> None:
    b = RetryBudget(RetryPolicy(max_attempts=2, backoff_base_s=1.0, backoff_max_s=4.0,
                                deadline_s=10.0), started_s=100.0)
    delays = [b.after_failure(SLOW_DOWN, n, 100.0 + n, 0.5) for n in (1, 2, 3)]
    assert delays == [0.5, 1.0, 2.0]  # three attempts although max_attempts is 2
    assert b.after_failure(SLOW_DOWN, 4, 107.0, 0.9) is None  # 107 + 0.9*4 > 110: stop now
    assert b.throttled == 4 and b.failed == 0


def test_other_failures_use_the_fixed_delay_and_the_attempt_limit() -> None:
    b = RetryBudget(RetryPolicy(max_attempts=3, fixed_delay_s=0.5), started_s=0.0)
    assert b.after_failure(RESET, 1, 0.0, 0.9) == 0.5
    assert b.after_failure(SLOW_DOWN, 2, 0.5, 0.5) == pytest.approx(0.05)  # not counted
    assert b.after_failure(RESET, 3, 1.0, 0.9) == 0.5  # 3 started, 1 throttled: 2 of 3 used
    assert b.after_failure(RESET, 4, 1.5, 0.9) is None
    assert (b.failed, b.throttled) == (3, 1)


def test_without_a_fixed_delay_other_failures_back_off_too() -> None:
    b = RetryBudget(RetryPolicy(max_attempts=5, backoff_base_s=0.2), started_s=0.0)
    assert [b.after_failure(RESET, n, 0.0, 0.5) for n in (1, 2, 3)] == pytest.approx(
        [0.1, 0.2, 0.4])


def test_non_retryable_errors_stop_at_once() -> None:
    b = RetryBudget(RetryPolicy(), started_s=0.0)
    assert b.after_failure(ObjectNotFoundError("get k: not found", key="k"), 1, 0.0, 0.5) is None


def test_attempt_names_bound_even_throttled_retries() -> None:
    b = RetryBudget(RetryPolicy(deadline_s=1e9, backoff_base_s=0.0), started_s=0.0)
    assert all(b.after_failure(SLOW_DOWN, n, 0.0, 0.5) == 0.0
               for n in range(1, MAX_ATTEMPT_NAMES))
    assert b.after_failure(SLOW_DOWN, MAX_ATTEMPT_NAMES, 0.0, 0.5) is None


@pytest.mark.parametrize(("field", "value"), [
    ("retry_backoff_base_s", 0), ("retry_backoff_base_s", float("nan")),
    ("retry_backoff_max_s", 0.05),  # below the base (0.1)
    ("retry_deadline_s", 0), ("retry_deadline_s", True), ("read_max_attempts", 0),
    ("read_max_attempts", 2.5)])
def test_bad_retry_options_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        DstlOptions(**{field: value})
    assert info.value.field == field


def test_retry_options_parse_from_spark_conf() -> None:
    o = DstlOptions.from_mapping({"spark.dstl.retry_deadline_s": "12.5",
                                  "spark.dstl.read_max_attempts": "4"})
    assert (o.retry_deadline_s, o.read_max_attempts) == (12.5, 4)
    assert RetryPolicy.for_store(o).max_attempts == 4
    assert RetryPolicy.for_uploads(o).fixed_delay_s == o.upload_retry_delay_s


# --------------------------------------------------------------------------- blocking loop


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def _failing(errors: list[BaseException], result: str = "ok") -> Callable[[], str]:
    def fn() -> str:
        if errors:
            raise errors.pop(0)
        return result
    return fn


def test_call_with_retries_backs_off_on_throttling_and_returns() -> None:
    clock = FakeClock()
    fn = _failing([SLOW_DOWN, SLOW_DOWN, SLOW_DOWN, SLOW_DOWN])
    out = call_with_retries(fn, RetryPolicy(max_attempts=2), translate=lambda e: e, what="get k",
                            clock=clock, sleep=clock.sleep, draw=lambda: 0.5)
    assert out == "ok"
    assert clock.sleeps == pytest.approx([0.05, 0.1, 0.2, 0.4])


def test_call_with_retries_gives_the_typed_error_within_the_deadline() -> None:
    clock = FakeClock()

    def fn() -> str:
        clock.now += 0.25  # each attempt takes a quarter second
        raise SLOW_DOWN

    with pytest.raises(ThrottledError):
        call_with_retries(fn, RetryPolicy(deadline_s=3.0, backoff_base_s=0.1, backoff_max_s=1.0),
                          translate=lambda e: e, what="get k", clock=clock, sleep=clock.sleep,
                          draw=lambda: 0.999)
    # the last backoff would have ended past the deadline, so it was not waited
    assert clock.now <= 3.0 + 0.25
    assert sum(clock.sleeps) + 0.25 * (len(clock.sleeps) + 1) == pytest.approx(clock.now)


def test_call_with_retries_stops_after_max_attempts_of_other_failures() -> None:
    clock = FakeClock()
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        raise ConnectionResetError("reset")

    with pytest.raises(TransientStorageError) as info:
        call_with_retries(fn, RetryPolicy(max_attempts=3),
                          translate=lambda e: TransientStorageError(str(e)), what="get k",
                          clock=clock, sleep=clock.sleep, draw=lambda: 0.5)
    assert len(calls) == 3 and isinstance(info.value.__cause__, ConnectionResetError)


# --------------------------------------------------------------------------- the upload scheduler


def _storage(store: ScriptedStore, timer: ManualTimer, **kw: Any) -> ChangelogStorage:
    base: dict[str, Any] = dict(persist_delay_s=0.0, upload_retry_delay_s=0.5,
                                upload_timeout_s=100.0, upload_max_attempts=3,
                                retry_backoff_base_s=0.1, retry_backoff_max_s=5.0)
    base.update(kw)
    return ChangelogStorage(store=store, options=DstlOptions(**base), timer=timer,
                            draw=lambda: 0.5)


def _persist(s: ChangelogStorage) -> Any:
    w = s.create_writer("w", KGS)
    w.append(1, b"x")
    return w.persist(0, 1)


def _advance_to_next(timer: ManualTimer, fut: Any, beyond: float) -> float | None:
    """Wait for the next retry timer (one due before the time ``beyond``) and fire it; return its
    delay, or ``None`` when the future finished instead."""
    done = threading.Event()
    fut.add_done_callback(lambda _f: done.set())
    for _ in range(1000):
        due = [d for d in timer.pending() if timer.now() + d < beyond]
        if due:
            timer.advance(due[0])
            return due[0]
        if done.wait(0.01):
            return None
    raise AssertionError(f"neither a retry nor an outcome; pending {timer.pending()}")


def test_throttled_uploads_back_off_with_full_jitter_beyond_the_attempt_limit() -> None:
    store, timer = ScriptedStore(["throttled"] * 4), ManualTimer()
    with _storage(store, timer) as s:
        f = _persist(s)
        delays = [_advance_to_next(timer, f, beyond=29.0) for _ in range(4)]
        assert delays == pytest.approx([0.05, 0.1, 0.2, 0.4])  # half of 0.1, 0.2, 0.4, 0.8
        h = f.result(WAIT)
        assert len(store.puts) == 5  # four throttled attempts did not use up the three
        assert h.change_sets[0].key == store.puts[-1]
        assert s.metrics()["ChangelogStorage.attemptsPerUpload.max"] == 5


def test_permanent_throttling_fails_typed_within_the_deadline() -> None:
    store, timer = ScriptedStore(["throttled"]), ManualTimer()
    store.forever = "throttled"
    with _storage(store, timer, retry_deadline_s=2.0, retry_backoff_max_s=1.0) as s:
        f = _persist(s)
        while _advance_to_next(timer, f, beyond=1.9) is not None:
            pass
        with pytest.raises(UploadFailedError, match=r"retry_deadline_s=2\.0") as info:
            f.result(WAIT)
        assert timer.now() <= 2.0
        assert info.value.attempts == len(store.puts) > 3
        assert isinstance(info.value.__cause__, ThrottledError)


def test_the_deadline_ends_an_upload_whose_attempt_hangs() -> None:
    store, timer = ScriptedStore(["hang"]), ManualTimer()
    with _storage(store, timer, retry_deadline_s=5.0) as s:
        f = _persist(s)
        assert store.hanging.acquire(timeout=WAIT)
        timer.advance(5.0)
        with pytest.raises(UploadFailedError, match=r"within retry_deadline_s=5\.0"):
            f.result(WAIT)
        store.release_hangs()  # the attempt lands late: a loser, deleted
        store.wait_deleted(store.puts[0])
        assert store.stored() == []
