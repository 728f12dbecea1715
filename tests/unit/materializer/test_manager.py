"""The materialization manager around the policy, with a fake snapshot source (no backend, no
store): triggers only wake the owner, a triggered attempt with nothing new or behind a guard
stays pending without moving the schedule, the write-batch deferral, failures, polled mode."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from dstl import KeyGroupRange
from dstl.errors import BackendFailedError, ClosedError
from dstl.metrics import MetricsRegistry
from dstl.timer import ManualTimer
from materializer.handles import SnapshotRef
from materializer.manager import MaterializationManager, MaterializedBase
from materializer.policy import MaterializationRules

WAIT = 10.0
KGS = KeyGroupRange(0, 7)


class FakeSource:
    """A log end to set by hand; snapshots that succeed, fail, or wait for a gate."""

    def __init__(self) -> None:
        self.end = 0
        self.taken: list[tuple[int, int]] = []
        self.fail: BaseException | None = None
        self.gate: threading.Event | None = None
        self.base_changes = 0

    def log_end(self) -> int:
        return self.end

    def take_snapshot(self, materialization_id: int, up_to: int
                      ) -> Callable[[], tuple[SnapshotRef, ...]]:
        self.taken.append((materialization_id, up_to))
        fail, gate = self.fail, self.gate

        def write() -> tuple[SnapshotRef, ...]:
            if gate is not None:
                assert gate.wait(WAIT)
            if fail is not None:
                raise fail
            return (SnapshotRef(f"snapshots/{materialization_id}", 100 * up_to, KGS,
                                materialization_id),)

        return write

    def base_changed(self) -> None:
        self.base_changes += 1


class Owner:
    """The owner thread's flag, as the backend keeps it."""

    def __init__(self) -> None:
        self.flag = False

    def wake(self) -> None:
        self.flag = True

    def attend(self, m: MaterializationManager) -> None:
        """What the backend does at a state access when its flag is up."""
        if self.flag:
            self.flag = False
            m.attend()


@pytest.fixture
def timer() -> Iterator[ManualTimer]:
    t = ManualTimer()
    yield t
    t.close()


def _manager(source: FakeSource, owner: Owner, timer: ManualTimer | None, *,
             interval: float | None = 60.0, ratio: float | None = None, min_log: int = 0,
             max_failures: int = 3, automatic: bool = True, defer: bool = False,
             first: float = 10.0) -> MaterializationManager:
    return MaterializationManager(
        "op/0", MaterializationRules(interval, ratio, min_log, max_failures), source,
        MetricsRegistry("ChangelogBackend.op/0."), wake=owner.wake, timer=timer,
        automatic=automatic, defer_in_batch=defer, uniform=lambda a, b: min(first, b))


def _wait(m: MaterializationManager) -> None:
    assert m.current is not None
    m.current.exception(WAIT)


def test_timer_only_wakes_the_owner_and_the_attempt_runs_at_its_next_access(
        timer: ManualTimer) -> None:
    src, owner = FakeSource(), Owner()
    m = _manager(src, owner, timer)
    assert timer.pending() == [10.0]
    src.end = 3
    timer.advance(10.0)
    assert owner.flag and src.taken == []  # nothing ran on the timer thread
    owner.attend(m)
    _wait(m)
    assert src.taken == [(1, 3)] and m.base == MaterializedBase(
        (SnapshotRef("snapshots/1", 300, KGS, 1),), 3, (), 1)
    assert src.base_changes == 1
    assert timer.pending() == [60.0]  # fixed delay after the attempt
    m.close()
    assert timer.pending() == []


def test_a_triggered_attempt_with_nothing_new_waits_for_the_next_change(
        timer: ManualTimer) -> None:
    src, owner = FakeSource(), Owner()
    m = _manager(src, owner, timer)
    timer.advance(10.0)
    owner.attend(m)  # log end 0 == boundary 0: nothing new
    assert m.current is None and timer.pending() == []  # the schedule did not move
    assert m.due()
    src.end = 1
    m.note_log(5)    # the next change wakes the owner
    assert owner.flag
    owner.attend(m)
    _wait(m)
    assert src.taken == [(1, 1)]
    m.close()


def test_a_trigger_behind_the_confirmation_guard_runs_once_confirmed(
        timer: ManualTimer) -> None:
    src, owner = FakeSource(), Owner()
    m = _manager(src, owner, timer)
    src.end = 1
    assert m.run_now(WAIT) is not None
    src.end = 2
    timer.advance(60.0)
    owner.attend(m)
    assert len(src.taken) == 1  # the previous one is not confirmed by a checkpoint yet
    assert timer.pending() == []
    m.confirm(1)
    assert owner.flag  # the pending trigger resumes
    owner.attend(m)
    _wait(m)
    assert src.taken == [(1, 1), (2, 2)]
    m.close()


def test_a_timer_request_made_during_an_attempt_is_stale_after_it(timer: ManualTimer) -> None:
    src, owner = FakeSource(), Owner()
    m = _manager(src, owner, timer, interval=5.0, first=5.0)
    src.gate = threading.Event()
    src.end = 1
    timer.advance(5.0)
    owner.attend(m)
    assert m.current is not None and not m.current.done()
    m.timer_fired()  # the timer fires again while the attempt runs
    src.gate.set()
    _wait(m)
    m.confirm(1)
    assert not m.due()  # due again 5 s after the attempt ended, not now
    m.close()


def test_size_trigger_fires_once_per_threshold_and_not_behind_a_guard() -> None:
    src, owner = FakeSource(), Owner()
    m = _manager(src, owner, None, interval=None, ratio=2.0, min_log=1000)
    m.note_log(1000)
    assert not owner.flag
    m.note_log(1)
    assert owner.flag
    src.end = 1
    owner.attend(m)
    _wait(m)
    assert m.log_bytes == 0
    # threshold now max(1000, 2 x 100): the guard (not confirmed) holds the next one back
    m.note_log(1500)
    src.end = 2
    owner.attend(m)
    assert len(src.taken) == 1
    m.note_log(1500)
    assert not owner.flag  # behind the guard the size trigger stays quiet
    m.confirm(1)
    assert owner.flag
    owner.attend(m)
    _wait(m)
    assert src.taken == [(1, 1), (2, 2)]
    m.close()


def test_an_open_write_batch_defers_the_attempt_to_its_end() -> None:
    src, owner = FakeSource(), Owner()
    m = _manager(src, owner, None, interval=None, defer=True)
    src.end = 4
    m.batch_opened()
    assert m.run_now(WAIT) is None and m.current is None
    m.batch_closed()
    assert owner.flag
    owner.attend(m)
    _wait(m)
    assert src.taken == [(1, 4)]
    m.close()


def test_failures_rearm_the_timer_then_fail_for_good(timer: ManualTimer) -> None:
    src, owner = FakeSource(), Owner()
    m = _manager(src, owner, timer, max_failures=1)
    src.fail = ConnectionResetError("injected")
    src.end = 1
    with pytest.raises(ConnectionResetError):
        m.run_now(WAIT)
    assert m.consecutive_failures == 1 and timer.pending() == [60.0]
    assert m.log_bytes == 0
    with pytest.raises(ConnectionResetError):
        m.run_now(WAIT)  # failure 2 > max_failures=1
    assert timer.pending() == []
    for _ in range(2):  # every later call raises, chained to the cause
        assert owner.flag
        with pytest.raises(BackendFailedError, match="max_failures=1") as info:
            owner.attend(m)
        assert isinstance(info.value.__cause__, ConnectionResetError)
    with pytest.raises(BackendFailedError):
        m.run_now(WAIT)
    m.close()


def test_polled_mode_has_no_timer_and_answers_due_from_the_policy() -> None:
    src, owner = FakeSource(), Owner()
    clock = ManualTimer()  # a clock only: polled mode schedules nothing on it
    m = _manager(src, owner, clock, ratio=1.0, min_log=50, automatic=False)
    assert clock.pending() == []
    assert not m.due()
    m.note_log(51)
    assert m.due() and not owner.flag  # polled: nobody is woken
    src.end = 1
    assert m.run_now(WAIT) is not None
    assert not m.due()
    clock.advance(60.0)
    assert m.due()
    m.close()
    zero = _manager(FakeSource(), owner, None, interval=0.0, automatic=False)
    assert zero.due()  # interval 0: due at every check
    zero.close()


def test_bases_made_elsewhere_restore_and_install() -> None:
    src, owner = FakeSource(), Owner()
    m = _manager(src, owner, None, interval=None, ratio=1.0, min_log=0)
    m.restored(MaterializedBase((SnapshotRef("snapshots/r", 10, KGS, 7),), 0, (), 7))
    assert m.next_materialization_id() == 8
    src.end = 2
    assert m.run_now(WAIT) is not None  # a restored base counts as confirmed
    assert m.base.materialization_id == 8
    m.note_log(10)
    installed = m.install(lambda b: MaterializedBase(
        (SnapshotRef("snapshots/x", 500, KGS, b.materialization_id + 1),), 2, (),
        b.materialization_id + 1))
    assert installed is not None and m.base.up_to == 2 and m.log_bytes == 0
    assert m.install(lambda b: None) is None
    m.note_log(500)  # the size trigger counts from the installed snapshot (500 bytes)
    assert not owner.flag
    m.note_log(1)
    assert owner.flag
    m.close()
    with pytest.raises(ClosedError):
        owner.flag = True
        owner.attend(m)
