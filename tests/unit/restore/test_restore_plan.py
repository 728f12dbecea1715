"""plan_restore: what a restore reads, decided from the handles alone (pure, no store)."""

from __future__ import annotations

import pytest

from dstl.errors import UsageError
from dstl.handle import ChangelogHandle, ChangeSetRef
from dstl.keygroups import KeyGroupRange
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef
from restore import RestorePlan, plan_restore


def _log(log_id: str, kgs: KeyGroupRange, first: int, n: int) -> ChangelogHandle:
    refs = tuple(ChangeSetRef(sqn, f"dstl/{log_id}-{sqn}.seg", 8, 40, 1, 4)
                 for sqn in range(first, first + n))
    return ChangelogHandle(log_id, kgs, first, first + n, refs)


def _handle(op: str, kgs: KeyGroupRange, *, cp: int = 7, mat: int = 1, mp: int = 128,
            snapshots: tuple[SnapshotRef, ...] = (),
            logs: tuple[ChangelogHandle, ...] = ()) -> ChangelogStateBackendHandle:
    return ChangelogStateBackendHandle(op, kgs, cp, mat, snapshots, logs, 0, mp)


LEFT, RIGHT = KeyGroupRange(0, 63), KeyGroupRange(64, 127)
SHARED = SnapshotRef("snapshots/shared.snap", 100, KeyGroupRange(0, 127), 1)
LEFT_SNAP = SnapshotRef("snapshots/left.snap", 100, LEFT, 2)
RIGHT_SNAP = SnapshotRef("snapshots/right.snap", 100, RIGHT, 3)


def test_scale_in_reads_every_intersecting_part_once_in_handle_order() -> None:
    a = _handle("op", LEFT, mat=2, snapshots=(SHARED, LEFT_SNAP), logs=(_log("op", LEFT, 5, 2),))
    b = _handle("op", RIGHT, mat=3, snapshots=(SHARED, RIGHT_SNAP),
                logs=(_log("op", RIGHT, 0, 3),))
    plan = plan_restore([a, b], KeyGroupRange(0, 127))
    assert plan == RestorePlan(operator_id="op", max_parallelism=128,
                               key_groups=KeyGroupRange(0, 127), checkpoint="7",
                               snapshots=(SHARED, LEFT_SNAP, RIGHT_SNAP),
                               logs=(a.non_materialized[0], b.non_materialized[0]),
                               materialization_id=3)


def test_scale_out_skips_parts_outside_the_new_range() -> None:
    a = _handle("op", LEFT, snapshots=(LEFT_SNAP,), logs=(_log("op", LEFT, 0, 1),))
    b = _handle("op", RIGHT, snapshots=(RIGHT_SNAP,), logs=(_log("op", RIGHT, 0, 1),))
    plan = plan_restore([a, b], KeyGroupRange(70, 80))
    assert plan.snapshots == (RIGHT_SNAP,)
    assert plan.logs == b.non_materialized


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
