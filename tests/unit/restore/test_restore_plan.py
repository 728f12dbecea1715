"""plan_restore: what a restore reads, decided from the handles alone (pure, no store).

Every change set once per key group, whatever handles are passed; the plan's
parts are restricted to the key groups they are read for (the restored backend's share)."""

from __future__ import annotations

import dataclasses

import pytest

from dstl.errors import UsageError
from dstl.handle import ChangelogHandle, ChangeSetRef
from dstl.keygroups import KeyGroupRange
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef
from restore import RestorePlan, plan_restore

ALL = KeyGroupRange(0, 127)
LEFT, RIGHT = KeyGroupRange(0, 63), KeyGroupRange(64, 127)


def _log(log_id: str, kgs: KeyGroupRange, first: int, n: int, *, seg: str = "",
         restrict: KeyGroupRange | None = None) -> ChangelogHandle:
    refs = tuple(ChangeSetRef(sqn, f"dstl/{seg or log_id}-{sqn}.seg", 8, 40, 1, 4)
                 for sqn in range(first, first + n))
    return ChangelogHandle(log_id, kgs, first, first + n, refs, 0, restrict)


def _handle(op: str, kgs: KeyGroupRange, *, cp: int = 7, mat: int = 1, mp: int = 128,
            snapshots: tuple[SnapshotRef, ...] = (),
            logs: tuple[ChangelogHandle, ...] = ()) -> ChangelogStateBackendHandle:
    return ChangelogStateBackendHandle(op, kgs, cp, mat, snapshots, logs, 0, mp)


def _applied(plan: RestorePlan) -> dict[tuple[str, int, str, int], list[int]]:
    """(log id, sqn, segment, key group) -> positions in the replay where that change set is
    applied to that key group (log ids repeat across generations: the segment tells them
    apart)."""
    out: dict[tuple[str, int, str, int], list[int]] = {}
    pos = 0
    for h in plan.logs:
        for r in h.change_sets:
            for kg in h.replay_key_groups:
                out.setdefault((h.log_id, r.sqn, r.key, kg), []).append(pos)
            pos += 1
    return out


SNAP_ALL = SnapshotRef("snapshots/old.snap", 100, ALL, 1)
LEFT_SNAP = SnapshotRef("snapshots/left.snap", 100, LEFT, 2)
RIGHT_SNAP = SnapshotRef("snapshots/right.snap", 100, RIGHT, 3)


def test_scale_in_reads_every_part_once_restricted_to_its_key_groups() -> None:
    a = _handle("op", LEFT, mat=2, snapshots=(LEFT_SNAP,), logs=(_log("op/0", LEFT, 5, 2),))
    b = _handle("op", RIGHT, mat=3, snapshots=(RIGHT_SNAP,), logs=(_log("op/1", RIGHT, 0, 3),))
    plan = plan_restore([a, b], ALL)
    assert plan == RestorePlan(operator_id="op", max_parallelism=128, key_groups=ALL,
                               checkpoint="7", snapshots=(LEFT_SNAP, RIGHT_SNAP),
                               logs=(a.non_materialized[0], b.non_materialized[0]),
                               materialization_id=3)


def test_scale_out_keeps_only_the_new_range() -> None:
    a = _handle("op", LEFT, snapshots=(LEFT_SNAP,), logs=(_log("op/0", LEFT, 0, 1),))
    b = _handle("op", RIGHT, snapshots=(RIGHT_SNAP,), logs=(_log("op/1", RIGHT, 0, 1),))
    part = KeyGroupRange(70, 80)
    plan = plan_restore([a, b], part)
    assert plan.snapshots == (dataclasses.replace(RIGHT_SNAP, key_groups=part),)
    assert plan.logs == (b.non_materialized[0].restricted(part),)
    assert plan.logs[0].replay_key_groups == part and plan.logs[0].key_groups == RIGHT


def test_one_two_one_applies_the_old_log_once_for_the_union() -> None:
    """After 1 -> 2 each half names the old snapshot and log restricted to its half; merging
    them back applies the old change sets once, to every key group, before the halves' own."""
    old = _log("op/p0", ALL, 0, 4)
    halves = [_handle(f"op/p{i}", r, snapshots=(SNAP_ALL.restricted(r),),  # type: ignore[arg-type]
                      logs=(old.restricted(r), _log(f"op/p{i}", r, 0, 2, seg=f"new{i}")))
              for i, r in enumerate((LEFT, RIGHT))]
    for handles in (halves, halves[::-1], halves * 3):
        plan = plan_restore(handles, ALL, operator_id="op/p0")
        assert plan.snapshots == (SNAP_ALL,)
        assert plan.logs[0] == old  # once, for the whole range
        applied = _applied(plan)
        assert all(len(v) == 1 for v in applied.values()), applied
        assert set(applied) == (
            {("op/p0", s, f"dstl/op/p0-{s}.seg", kg) for s in range(4) for kg in ALL}
            | {(f"op/p{i}", s, f"dstl/new{i}-{s}.seg", kg) for i, r in enumerate((LEFT, RIGHT))
               for s in range(2) for kg in r})
        # per key group, the old change sets come first
        for kg in ALL:
            mine = sorted((p[0], seg) for (_, _, seg, k), p in applied.items() if k == kg)
            assert [seg.startswith("dstl/op/") for _, seg in mine] == [True] * 4 + [False] * 2


def test_untrimmed_handles_are_read_for_their_own_range_only() -> None:
    """Handles written before trimming name the whole old log; each applies to its range."""
    old = _log("op/p0", ALL, 0, 4)
    halves = [_handle(f"op/p{i}", r, logs=(old, _log(f"op/p{i}", r, 0, 1, seg=f"n{i}")))
              for i, r in enumerate((LEFT, RIGHT))]
    plan = plan_restore(halves, ALL, operator_id="m")
    assert all(len(v) == 1 for v in _applied(plan).values())
    assert plan.logs[0] == old


def test_the_same_handle_several_times_plans_as_once() -> None:
    h = _handle("op", ALL, snapshots=(SNAP_ALL,), logs=(_log("op", ALL, 3, 5),))
    assert plan_restore([h, h, h], ALL) == plan_restore([h], ALL)
    # a handle naming one change set twice applies it once
    twice = _handle("op", ALL, logs=(_log("op", ALL, 3, 5), _log("op", ALL, 3, 5)))
    assert _applied(plan_restore([twice], ALL)) == _applied(plan_restore([h], ALL))


def test_an_older_checkpoint_of_the_same_backend_is_a_prefix() -> None:
    older = _handle("op", ALL, cp=1, logs=(_log("op", ALL, 0, 2),))
    newer = _handle("op", ALL, cp=2, logs=(_log("op", ALL, 0, 5),))
    empty = _handle("op", ALL, cp=0)
    for handles in ([older, newer], [newer, older], [empty, older, newer]):
        plan = plan_restore(handles, ALL)
        assert [r.sqn for h in plan.logs for r in h.change_sets] == [0, 1, 2, 3, 4]


def test_handles_that_disagree_about_a_key_group_are_refused() -> None:
    mine = _handle("op", ALL, logs=(_log("op", ALL, 0, 2),))
    other = _handle("other", LEFT, logs=(_log("other", LEFT, 0, 2),))
    with pytest.raises(UsageError, match=r"disagree about key groups \[0, 63\].*'other'"):
        plan_restore([mine, other], ALL, operator_id="x")
    materialized = _handle("op", ALL, cp=9, snapshots=(SNAP_ALL,), logs=(_log("op", ALL, 2, 1),))
    with pytest.raises(UsageError, match="disagree"):
        plan_restore([mine, materialized], ALL)
    # two records claiming one change set, differently
    changed = _handle("op", ALL, logs=(dataclasses.replace(
        _log("op", ALL, 0, 2), change_sets=tuple(dataclasses.replace(r, length=41)
                                                 for r in _log("op", ALL, 0, 2).change_sets)),))
    with pytest.raises(UsageError, match="disagree about change set"):
        plan_restore([mine, changed], ALL)


def test_histories_ordering_change_sets_both_ways_are_refused() -> None:
    x, y = _log("x", ALL, 0, 1), _log("y", ALL, 0, 1)
    a = _handle("a", LEFT, logs=(x, y))
    b = _handle("b", RIGHT, logs=(y, x))
    with pytest.raises(UsageError, match="inconsistently"):
        plan_restore([a, b], ALL, operator_id="m")


def test_overlapping_snapshots_in_one_handle_are_refused() -> None:
    h = _handle("op", LEFT, snapshots=(SNAP_ALL, LEFT_SNAP))
    with pytest.raises(UsageError, match="several snapshots"):
        plan_restore([h], ALL)


def test_a_change_set_for_two_separate_ranges_is_one_handle_per_range() -> None:
    old = _log("old", ALL, 0, 3)
    parts = [KeyGroupRange(0, 9), KeyGroupRange(20, 29)]
    handles = [_handle(f"p{i}", r, logs=(old.restricted(r),))  # type: ignore[arg-type]
               for i, r in enumerate(parts)]
    plan = plan_restore(handles, ALL, operator_id="m")
    assert [h.replay_key_groups for h in plan.logs] == parts
    assert all(h.change_sets == old.change_sets for h in plan.logs)


def test_ids_and_parallelism_come_from_the_handles_or_the_caller() -> None:
    a = _handle("op-a", LEFT, cp=3)
    b = _handle("op-b", RIGHT, cp=4)
    with pytest.raises(UsageError, match="cannot infer operator_id"):
        plan_restore([a, b], LEFT)
    plan = plan_restore([a, b], LEFT, operator_id="merged")
    assert (plan.operator_id, plan.checkpoint) == ("merged", "3,4")
    with pytest.raises(UsageError, match="disagree on max_parallelism"):
        plan_restore([a, _handle("op-a", RIGHT, mp=256)], LEFT)
    with pytest.raises(UsageError, match="cannot be remapped"):
        plan_restore([a], LEFT, max_parallelism=256)
    assert plan_restore([a], LEFT, max_parallelism=128).max_parallelism == 128


def test_no_handles_needs_both_ids_and_reads_nothing() -> None:
    with pytest.raises(UsageError):
        plan_restore([], LEFT, max_parallelism=128)
    with pytest.raises(UsageError):
        plan_restore([], LEFT, operator_id="op")
    plan = plan_restore([], LEFT, operator_id="op", max_parallelism=128)
    assert (plan.snapshots, plan.logs, plan.checkpoint, plan.materialization_id) == \
        ((), (), "?", 0)


def test_a_restriction_round_trips_and_is_checked() -> None:
    h = _log("op", ALL, 0, 2, restrict=LEFT)
    assert ChangelogHandle.from_json(h.to_json()) == h
    assert "restrict" not in _log("op", ALL, 0, 2).to_json()  # older readers see no change
    assert _log("op", ALL, 0, 2, restrict=ALL).restrict is None  # normalized
    assert h.restricted(RIGHT) is None
    assert h.restricted(KeyGroupRange(10, 200)).replay_key_groups == KeyGroupRange(10, 63)
    with pytest.raises(UsageError, match="restrict"):
        _log("op", LEFT, 0, 2, restrict=RIGHT)
    with pytest.raises(UsageError, match="restrict"):
        _log("op", LEFT, 0, 2, restrict=KeyGroupRange(5, 4))
    with pytest.raises(UsageError):
        ChangelogHandle.from_json(h.to_json().replace('"restrict":[0,63]', '"restrict":[0]'))
