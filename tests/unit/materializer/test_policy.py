"""The materialization policy on plain values: first delay, fixed delay, size trigger, nothing
new, failure accounting, snapshots made elsewhere; and the same rules against a small model
under random event sequences (Hypothesis)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dstl.errors import ConfigError
from materializer.options import BackendOptions
from materializer.policy import MaterializationPolicy, MaterializationRules, Uniform

RULES = MaterializationRules(interval_s=60.0, log_ratio=2.0, min_log_bytes=1000, max_failures=2)


def fixed(u: float) -> Uniform:
    """A uniform source that always answers ``u`` (clamped like random.uniform's range)."""
    return lambda a, b: min(max(u, a), b)


def test_rules_come_from_backend_options() -> None:
    opts = BackendOptions(materialization_interval_s=5.0, materialize_log_ratio=3.0,
                          materialize_min_log_bytes=7, max_failures=1)
    assert MaterializationRules.of(opts) == MaterializationRules(5.0, 3.0, 7, 1)


def test_first_delay_is_drawn_in_the_interval_then_fixed_delay_after_each_attempt() -> None:
    draws: list[tuple[float, float]] = []

    def uniform(a: float, b: float) -> float:
        draws.append((a, b))
        return 12.5

    p = MaterializationPolicy(RULES, uniform=uniform)
    assert p.next_due == math.inf and p.delay(0.0) is None  # not started: never due
    assert p.start(100.0) == 112.5
    assert draws == [(0.0, 60.0)]
    assert p.delay(100.0) == 12.5 and p.delay(200.0) == 0.0
    assert not p.due(112.4, 0) and p.due(112.5, 0)
    p.record_success(130.0, boundary=7, snapshot_bytes=10)
    assert p.next_due == 190.0
    assert p.record_failure(200.0) is False
    assert p.next_due == 260.0
    p.record_empty(300.0)
    assert p.next_due == 360.0
    assert draws == [(0.0, 60.0)]  # only the first delay is random


def test_interval_zero_is_due_at_every_check_and_none_never_by_time() -> None:
    p = MaterializationPolicy(MaterializationRules(0.0, None, 0, 3))
    assert p.start(5.0) == 5.0 and p.due(5.0, 0)
    p.record_success(9.0, 1, 100)
    assert p.due(9.0, 0)
    off = MaterializationPolicy(MaterializationRules(None, None, 0, 3))
    off.start(5.0)
    assert not off.due(1e12, 10 ** 12) and off.delay(5.0) is None
    off.record_success(6.0, 1, 1)
    assert off.next_due == math.inf


def test_uniform_rounding_to_the_upper_bound_stays_in_the_interval() -> None:
    p = MaterializationPolicy(RULES, uniform=lambda a, b: b + 1e-9)
    assert p.start(0.0) <= 60.0


def test_size_trigger_threshold_is_the_larger_of_floor_and_ratio() -> None:
    p = MaterializationPolicy(RULES, uniform=fixed(59.0))
    p.start(0.0)
    assert p.size_threshold == 1000  # no snapshot size known: the floor alone
    assert not p.due(0.0, 1000) and p.due(0.0, 1001)
    assert p.due_at(1001) == -math.inf and p.due_at(10) == 59.0
    p.record_success(1.0, boundary=3, snapshot_bytes=800)
    assert p.size_threshold == 1600
    assert not p.size_due(1600) and p.size_due(1601)
    no_ratio = MaterializationPolicy(MaterializationRules(60.0, None, 0, 3))
    assert no_ratio.size_threshold == math.inf and not no_ratio.size_due(10 ** 15)


def test_nothing_new_since_the_boundary_starts_nothing_and_moves_nothing() -> None:
    p = MaterializationPolicy(RULES, uniform=fixed(0.0), boundary=0)
    p.start(0.0)
    assert not p.has_new(0) and not p.has_new(None) and p.has_new(1)
    assert not p.should_start(10.0, 0, 0)
    assert p.next_due == 0.0  # still due: it runs as soon as something new arrives
    assert p.should_start(10.0, 0, 4)
    p.record_success(10.0, boundary=4, snapshot_bytes=1)
    assert not p.should_start(1e9, 10 ** 9, 4)
    agent_boundary = ("dstl/seg-1", 17)  # boundaries are compared for equality only
    p.record_snapshot(agent_boundary, 5)
    assert not p.has_new(("dstl/seg-1", 17)) and p.has_new(("dstl/seg-1", 18))


def test_failures_over_max_fail_for_good_and_a_success_resets_the_count() -> None:
    p = MaterializationPolicy(RULES, uniform=fixed(0.0))
    p.start(0.0)
    assert p.record_failure(1.0) is False and p.record_failure(2.0) is False
    p.record_success(3.0, 1, 10)
    assert p.consecutive_failures == 0
    assert [p.record_failure(t) for t in (4.0, 5.0, 6.0)] == [False, False, True]
    assert p.has_failed
    assert not p.due(1e12, 10 ** 12) and p.delay(0.0) is None and p.due_at(10 ** 12) == math.inf


def test_snapshots_made_elsewhere_keep_schedule_and_failures() -> None:
    p = MaterializationPolicy(RULES, uniform=fixed(30.0))
    p.start(0.0)
    p.record_failure(1.0)
    p.record_snapshot(("k", 1), 4000)
    assert (p.next_due, p.consecutive_failures, p.snapshot_bytes) == (61.0, 1, 4000)
    p.record_snapshot(0)  # a restore: size not known, the previous stays
    assert p.boundary == 0 and p.snapshot_bytes == 4000


def test_request_makes_it_due_now_without_delaying_an_earlier_due_time() -> None:
    p = MaterializationPolicy(RULES, uniform=fixed(50.0))
    p.start(0.0)
    p.request(10.0)
    assert p.next_due == 10.0
    p.request(20.0)
    assert p.next_due == 10.0


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, True, "60"])
def test_interval_validation(bad: object) -> None:
    with pytest.raises(ConfigError, match="materialization_interval_s"):
        BackendOptions(materialization_interval_s=bad)  # type: ignore[arg-type]


def test_interval_zero_is_a_valid_setting() -> None:
    assert BackendOptions(materialization_interval_s=0.0).materialization_interval_s == 0.0
    with pytest.raises(ConfigError, match="materialize_log_ratio"):
        BackendOptions(materialize_log_ratio=0.0)


# ----------------------------------------------------------------- the rules vs a model

EVENTS = st.lists(st.tuples(
    st.sampled_from(["success", "failure", "empty", "installed"]),
    st.floats(0.0, 1000.0),                # time since the previous event
    st.integers(0, 5),                     # boundary
    st.integers(0, 10 ** 6),               # snapshot bytes / log bytes
), max_size=40)


@given(interval=st.one_of(st.none(), st.floats(0.0, 500.0)),
       ratio=st.one_of(st.none(), st.floats(0.1, 10.0)),
       min_log=st.integers(0, 10 ** 5), max_failures=st.integers(0, 4),
       u=st.floats(0.0, 1.0), start=st.floats(0.0, 1e6), events=EVENTS)
def test_policy_follows_its_rules_under_any_event_sequence(
        interval: float | None, ratio: float | None, min_log: int, max_failures: int, u: float,
        start: float, events: list[tuple[str, float, int, int]]) -> None:
    rules = MaterializationRules(interval, ratio, min_log, max_failures)
    p = MaterializationPolicy(rules, uniform=lambda a, b: a + u * (b - a), boundary=0)
    now = start
    first = p.start(now)
    # model
    due_time = math.inf if interval is None else now + u * interval
    assert first == due_time
    failures, boundary, snap = 0, 0, 0
    for kind, dt, b, n in events:
        now += dt
        if kind == "success":
            p.record_success(now, b, n)
            failures, boundary, snap = 0, b, n
        elif kind == "failure":
            failures += 1
            assert p.record_failure(now) is (failures > max_failures)
        elif kind == "empty":
            p.record_empty(now)
        else:
            p.record_snapshot(b, n)
            boundary, snap = b, n
        if kind != "installed":
            due_time = math.inf if interval is None else now + interval
        assert (p.consecutive_failures, p.boundary, p.next_due) == (failures, boundary, due_time)
        threshold = math.inf if ratio is None else max(min_log, ratio * snap)
        assert p.size_threshold == threshold
        failed = failures > max_failures
        assert p.has_failed == failed
        for t in (now, now + 1e-3, due_time):
            for log in (0, n, 2 * n + 1):
                assert p.due(t, log) == (not failed and (t >= due_time or log > threshold))
        assert p.has_new(b) == (b != boundary) and not p.has_new(None)


def test_owner_may_count_the_log_from_another_snapshot_size() -> None:
    """The agent measures the log of the worker's checkpoint, which starts at the snapshot that
    checkpoint references, not at the agent's own newest one."""
    p = MaterializationPolicy(RULES, uniform=fixed(59.0))
    p.start(0.0)
    p.record_success(1.0, boundary=("k", 1), snapshot_bytes=5000)  # threshold 10,000
    assert not p.size_due(3000) and p.size_due(3000, snapshot_bytes=1000)
    assert p.due(2.0, 3000, snapshot_bytes=1000) and not p.due(2.0, 3000)
    assert p.should_start(2.0, 3000, ("k", 2), snapshot_bytes=1000)
