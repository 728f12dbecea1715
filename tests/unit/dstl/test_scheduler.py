"""Batching scheduler and retrying upload: Flink's BatchingStateChangeUploadSchedulerTest and
RetryingExecutorTest, re-expressed with a manual timer (no sleeps) and a scripted store."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from support.fakes import ScriptedStore

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import ClosedError, UploadFailedError, UploadTimeoutError
from dstl.timer import ManualTimer
from restore import ChangelogReader

KGS = KeyGroupRange(0, 7)
WAIT = 10.0


def _storage(store: ScriptedStore, timer: ManualTimer, **kw: object) -> ChangelogStorage:
    base: dict[str, object] = dict(persist_delay_s=0.0, upload_retry_delay_s=0.5,
                                   upload_timeout_s=1.0, upload_max_attempts=3, upload_threads=4)
    base.update(kw)
    return ChangelogStorage(store=store, options=DstlOptions(**base),  # type: ignore[arg-type]
                            timer=timer)


@pytest.fixture
def store() -> ScriptedStore:
    return ScriptedStore()


@pytest.fixture
def timer() -> ManualTimer:
    return ManualTimer()


def _settle(s: ChangelogStorage) -> None:
    s._discard.submit(lambda: None).result(WAIT)


def _persist_one(s: ChangelogStorage, name: str = "w", payload: bytes = b"x") -> object:
    w = s.create_writer(name, KGS)
    w.append(1, payload)
    return w.persist(0, 1)


# ----------------------------------------------------------------- batching


def test_no_delay_uploads_immediately(store: ScriptedStore, timer: ManualTimer) -> None:
    with _storage(store, timer) as s:
        _persist_one(s).result(WAIT)  # type: ignore[attr-defined]
        assert len(store.puts) == 1


def test_delay_is_scheduled_with_the_configured_value_and_batches_writers(
        store: ScriptedStore, timer: ManualTimer) -> None:
    with _storage(store, timer, persist_delay_s=0.25) as s:
        futs = [_persist_one(s, f"w{i}") for i in range(8)]
        assert store.puts == []
        assert timer.pending() == [pytest.approx(0.25)]
        timer.advance(0.25)
        handles = [f.result(WAIT) for f in futs]  # type: ignore[attr-defined]
        assert len(store.puts) == 1
        assert {h.change_sets[0].key for h in handles} == set(store.puts)
        m = s.metrics()
        assert m["ChangelogStorage.uploadBatchSizes.max"] == 8
        assert m["ChangelogStorage.writersPerSegment.max"] == 8


def test_size_threshold_uploads_at_once(store: ScriptedStore, timer: ManualTimer) -> None:
    with _storage(store, timer, persist_delay_s=10.0, persist_size_threshold_bytes=1000) as s:
        f_small = _persist_one(s, "small", b"a")
        assert store.puts == []
        f_big = _persist_one(s, "big", b"b" * 2000)
        f_small.result(WAIT)  # type: ignore[attr-defined]
        f_big.result(WAIT)  # type: ignore[attr-defined]
        assert len(store.puts) == 1  # both went into the one segment


def test_queue_size_metric_before_and_after_draining(store: ScriptedStore,
                                                     timer: ManualTimer) -> None:
    with _storage(store, timer, persist_delay_s=1.0) as s:
        f = _persist_one(s)
        assert s.metrics()["ChangelogStorage.uploadQueueSize"] == 1
        timer.advance(1.0)
        f.result(WAIT)  # type: ignore[attr-defined]
        assert s.metrics()["ChangelogStorage.uploadQueueSize"] == 0
        assert s.metrics()["ChangelogStorage.inFlightBytes"] == 0


# ----------------------------------------------------------------- back-pressure


def test_back_pressure_blocks_until_capacity_is_released(store: ScriptedStore,
                                                         timer: ManualTimer) -> None:
    store.script = ["hang"]
    with _storage(store, timer, max_in_flight_bytes=100, persist_size_threshold_bytes=100,
                  upload_timeout_s=100.0) as s:
        first = _persist_one(s, "a", b"x" * 80)
        assert store.hanging.acquire(timeout=WAIT)
        assert not s.available()
        done = threading.Event()
        box: dict[str, object] = {}

        def second() -> None:
            box["f"] = _persist_one(s, "b", b"y" * 80)  # blocks: 80 + 80 > 100
            done.set()

        t = threading.Thread(target=second, name="test-second")
        t.start()
        assert not done.wait(0.2)  # still blocked (a bounded look, not synchronisation)
        store.release_hangs()
        assert done.wait(WAIT)
        t.join()
        first.result(WAIT)  # type: ignore[attr-defined]
        box["f"].result(WAIT)  # type: ignore[attr-defined]
        assert s.metrics()["ChangelogStorage.backPressureTimeSeconds"] > 0


def test_back_pressure_deadline_gives_a_typed_error(store: ScriptedStore,
                                                    timer: ManualTimer) -> None:
    store.script = ["hang"]
    with _storage(store, timer, max_in_flight_bytes=100, persist_size_threshold_bytes=100,
                  back_pressure_timeout_s=0.05, upload_timeout_s=100.0) as s:
        _persist_one(s, "a", b"x" * 80)
        assert store.hanging.acquire(timeout=WAIT)
        w = s.create_writer("b", KGS)
        w.append(1, b"y" * 80)
        with pytest.raises(UploadTimeoutError, match="max_in_flight_bytes=100"):
            w.persist(0, 1)
        # those change sets can never become durable: the writer says so
        assert w.has_failed() is not None
        store.release_hangs()


def test_close_unblocks_a_waiting_caller(store: ScriptedStore, timer: ManualTimer) -> None:
    store.script = ["hang"]
    s = _storage(store, timer, max_in_flight_bytes=100, persist_size_threshold_bytes=100,
                 upload_timeout_s=100.0, upload_max_attempts=1)
    _persist_one(s, "a", b"x" * 80)
    assert store.hanging.acquire(timeout=WAIT)
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            _persist_one(s, "b", b"y" * 80)
        except ClosedError as exc:
            errors.append(exc)

    t = threading.Thread(target=blocked, name="test-blocked")
    t.start()
    closer = threading.Thread(target=lambda: s.scheduler.close(timeout_s=0.5), name="test-close")
    closer.start()
    t.join(WAIT)
    store.release_hangs()
    closer.join(WAIT)
    s.close()
    assert len(errors) == 1 and "closed" in str(errors[0])


# ----------------------------------------------------------------- retries (RetryingExecutorTest)


def test_no_retries_with_one_attempt(store: ScriptedStore, timer: ManualTimer) -> None:
    store.script = ["transient"]
    with _storage(store, timer, upload_max_attempts=1) as s:
        with pytest.raises(UploadFailedError) as info:
            _persist_one(s).result(WAIT)  # type: ignore[attr-defined]
        assert info.value.attempts == 1 and len(store.puts) == 1


def test_fixed_attempt_limit_is_exact(store: ScriptedStore, timer: ManualTimer) -> None:
    store.script = ["transient"] * 5
    with _storage(store, timer, upload_max_attempts=3) as s:
        f = _persist_one(s)
        for _ in range(2):
            timer.wait_for_pending(0.5)  # the retry delay after each I/O error
            timer.advance(0.5)
        with pytest.raises(UploadFailedError, match="3 attempt") as info:
            f.result(WAIT)  # type: ignore[attr-defined]
        assert info.value.attempts == 3 and len(store.puts) == 3
        assert s.metrics()["ChangelogStorage.numberOfUploadFailures"] == 3


def test_success_on_the_nth_attempt(store: ScriptedStore, timer: ManualTimer) -> None:
    store.script = ["transient", "transient"]
    with _storage(store, timer, upload_max_attempts=3) as s:
        w = s.create_writer("w", KGS)
        w.append(1, b"payload")
        f = w.persist(0, 1)
        for _ in range(2):
            timer.wait_for_pending(0.5)
            timer.advance(0.5)
        h = f.result(WAIT)
        assert list(ChangelogReader(s).read(h)) == [(1, b"payload")]
        _settle(s)
        assert store.stored() == [h.change_sets[0].key]  # no duplicate object (G6)
        m = s.metrics()
        assert m["ChangelogStorage.attemptsPerUpload.max"] == 3


def test_non_retryable_error_is_not_retried(store: ScriptedStore, timer: ManualTimer) -> None:
    store.script = ["fatal"]
    with _storage(store, timer) as s:
        with pytest.raises(UploadFailedError, match="non-retryable") as info:
            _persist_one(s).result(WAIT)  # type: ignore[attr-defined]
        assert len(store.puts) == 1 and info.value.attempts == 1
        assert timer.pending() == []  # no retry was scheduled


def test_retry_delay_applies_to_io_errors(store: ScriptedStore, timer: ManualTimer) -> None:
    store.script = ["transient"]
    with _storage(store, timer, upload_retry_delay_s=0.7) as s:
        f = _persist_one(s)
        timer.wait_for_pending(0.7)
        assert len(store.puts) == 1  # nothing retried before the delay
        timer.advance(0.7)
        f.result(WAIT)  # type: ignore[attr-defined]
        assert len(store.puts) == 2


def test_timeout_starts_a_concurrent_attempt_and_the_loser_is_deleted(
        store: ScriptedStore, timer: ManualTimer) -> None:
    store.script = ["hang"]
    with _storage(store, timer, upload_timeout_s=1.0) as s:
        f = _persist_one(s)
        assert store.hanging.acquire(timeout=WAIT)
        timer.advance(1.0)  # attempt 1 is slow: attempt 2 starts at once, no retry delay
        h = f.result(WAIT)  # type: ignore[attr-defined]
        assert len(store.puts) == 2 and h.change_sets[0].key == store.puts[1]
        store.release_hangs()  # the slow attempt lands late and loses
        store.wait_deleted(store.puts[0])
        assert store.stored() == [store.puts[1]]
        assert s.metrics()["ChangelogStorage.totalAttemptsPerUpload.max"] == 2


def test_last_attempt_timing_out_fails_within_the_deadline(store: ScriptedStore,
                                                           timer: ManualTimer) -> None:
    store.script = ["hang", "hang", "hang"]
    with _storage(store, timer, upload_timeout_s=1.0, upload_max_attempts=3) as s:
        f = _persist_one(s)
        for _ in range(3):
            assert store.hanging.acquire(timeout=WAIT)
            timer.advance(1.0)
        with pytest.raises(UploadFailedError, match="timed out") as info:
            f.result(WAIT)  # type: ignore[attr-defined]
        assert info.value.attempts == 3
        store.release_hangs()


def test_ghost_success_is_cleaned_up(store: ScriptedStore, timer: ManualTimer) -> None:
    """The write landed but the client saw an error: the retry wins, the ghost is deleted."""
    store.script = ["ghost"]
    with _storage(store, timer, upload_retry_delay_s=0.0) as s:
        h = _persist_one(s).result(WAIT)  # type: ignore[attr-defined]
        _settle(s)
        assert store.stored() == [h.change_sets[0].key]
        assert store.puts[0] in store.deletes


def test_all_futures_of_a_batch_fail_together(store: ScriptedStore, timer: ManualTimer) -> None:
    store.script = ["fatal"]
    with _storage(store, timer, persist_delay_s=1.0) as s:
        futs = [_persist_one(s, f"w{i}") for i in range(3)]
        timer.advance(1.0)
        for f in futs:
            with pytest.raises(UploadFailedError):
                f.result(WAIT)  # type: ignore[attr-defined]


def test_close_sends_what_is_queued(store: ScriptedStore, timer: ManualTimer) -> None:
    s = _storage(store, timer, persist_delay_s=100.0)
    f = _persist_one(s)
    s.close()
    assert f.result(WAIT).change_sets[0].key in store.stored()  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _release_hangs(store: ScriptedStore) -> Iterator[None]:
    yield
    store.release_hangs()


def test_last_attempt_failing_while_only_timed_out_attempts_run_does_not_hang(
        store: ScriptedStore, timer: ManualTimer) -> None:
    """Attempt 1 hangs past its timeout; attempts 2 and 3 fail: give up, do not wait for 1."""
    store.script = ["hang", "transient", "transient"]
    with _storage(store, timer, upload_timeout_s=1.0, upload_max_attempts=3,
                  upload_retry_delay_s=0.5) as s:
        f = _persist_one(s)
        assert store.hanging.acquire(timeout=WAIT)
        timer.advance(1.0)                 # attempt 1 timed out: attempt 2 starts and fails
        timer.wait_for_pending(0.5)
        timer.advance(0.5)                 # attempt 3 starts and fails
        with pytest.raises(UploadFailedError) as info:
            f.result(WAIT)  # type: ignore[attr-defined]
        assert info.value.attempts == 3
        store.release_hangs()
