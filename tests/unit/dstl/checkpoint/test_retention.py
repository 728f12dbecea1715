"""The planners of dstl.checkpoint.retention; pure: plain values in, plans out, no store, no clock.

The retention property test checks guarantee G5 on random checkpoint sequences: no deleted object
is referenced by a retained or pending checkpoint, and nothing referenced only by subsumed
checkpoints stays. The orphan property test checks the orphan rule on random listings: a key is
selected iff no checkpoint references it and its name says it is at least the grace period old;
every listed key lands in exactly one of the plan's groups.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dstl.checkpoint.retention import (
    CheckpointRefs,
    ListedObject,
    OrphanPlan,
    plan_orphans,
    plan_retention,
)
from dstl.errors import UsageError
from dstl.layout import manifest_key, segment_key

# --------------------------------------------------------------------------- retention planner


def refs(cid: int, keys: set[str], attempt: int = 1) -> CheckpointRefs:
    return CheckpointRefs(cid, attempt, frozenset(keys))


def test_plan_keeps_the_newest_and_deletes_only_unreferenced() -> None:
    retained = [refs(1, {"dstl/a", "dstl/b"}), refs(2, {"dstl/b", "dstl/c"})]
    plan = plan_retention(retained, refs(3, {"dstl/c", "dstl/d"}), retain=2,
                          pending=[{"dstl/a"}])
    assert [r.checkpoint_id for r in plan.retained] == [2, 3]
    assert [r.checkpoint_id for r in plan.subsumed] == [1]
    assert plan.delete_manifests == (manifest_key(1, 1),)
    assert plan.delete_objects == ()  # b is retained by 2, a is pinned by the pending one
    assert plan.deferred_objects == ("dstl/a",)
    nxt = plan_retention(plan.retained, refs(4, {"dstl/d"}), retain=2,
                         doomed_objects=plan.deferred_objects)
    assert nxt.delete_objects == ("dstl/a", "dstl/b")


def test_plan_new_attempt_replaces_the_old_one() -> None:
    retained = [refs(1, {"dstl/a"}), refs(2, {"dstl/b", "dstl/x"})]
    plan = plan_retention(retained, refs(2, {"dstl/b", "dstl/y"}, attempt=2), retain=3)
    assert [r.order for r in plan.retained] == [(1, 1), (2, 2)]
    assert [r.order for r in plan.subsumed] == [(2, 1)]
    assert plan.delete_manifests == (manifest_key(2, 1),)
    assert plan.delete_objects == ("dstl/x",)


@pytest.mark.parametrize("retained,completed,retain", [
    ([refs(5, set())], refs(4, set()), 2),
    ([refs(5, set(), attempt=2)], refs(5, set(), attempt=1), 2),
    ([refs(5, set()), refs(5, set(), attempt=2)], refs(6, set()), 2),
    ([], refs(1, set()), 0),
])
def test_plan_rejects_impossible_inputs(retained: list[CheckpointRefs],
                                        completed: CheckpointRefs, retain: int) -> None:
    with pytest.raises(UsageError):
        plan_retention(retained, completed, retain=retain)


@given(st.data())
def test_planner_never_deletes_a_referenced_key_and_leaves_nothing_unreferenced(
        data: st.DataObject) -> None:
    retain = data.draw(st.integers(1, 4), label="retain")
    steps = data.draw(st.integers(1, 25), label="steps")
    retained: list[CheckpointRefs] = []
    carried: tuple[str, ...] = ()
    stored: set[str] = set()  # objects that exist (referenced at some point, not yet deleted)
    fresh = iter(f"dstl/{i:06d}" for i in range(10**6))
    next_id = 0
    for step in range(steps):
        usable = sorted({k for r in retained for k in r.keys} | set(carried))
        new = {next(fresh) for _ in range(data.draw(st.integers(0, 3), label="new keys"))}
        reused = set(data.draw(st.lists(st.sampled_from(usable), max_size=6), label="reused")
                     if usable else [])
        keys = frozenset(new | reused)
        stored |= new
        last = step == steps - 1
        pending = [] if last or not usable else data.draw(st.lists(
            st.sets(st.sampled_from(usable), max_size=4), max_size=2), label="pending")
        rerun = data.draw(st.booleans(), label="re-run")
        if retained and rerun:
            completed = CheckpointRefs(retained[-1].checkpoint_id, retained[-1].attempt + 1, keys)
        else:
            next_id += data.draw(st.integers(1, 3), label="id gap")
            completed = CheckpointRefs(next_id, 1, keys)
        plan = plan_retention(retained, completed, retain=retain, pending=pending,
                              doomed_objects=carried)
        kept = {k for r in plan.retained for k in r.keys}
        pinned = {k for p in pending for k in p}
        deleted = set(plan.delete_objects)
        # G5, safety: nothing retained or pending is deleted.
        assert not deleted & kept, deleted & kept
        assert not deleted & pinned, deleted & pinned
        # The retained set: newest ids, the completion last, one attempt per id.
        assert plan.retained[-1] == completed and len(plan.retained) <= retain
        assert len({r.checkpoint_id for r in plan.retained}) == len(plan.retained)
        assert sorted(plan.retained + plan.subsumed, key=lambda r: r.order) == \
            sorted([*retained, completed], key=lambda r: r.order)
        assert plan.delete_manifests == tuple(r.manifest_key for r in plan.subsumed)
        stored -= deleted
        retained, carried = list(plan.retained), plan.deferred_objects
        # G5, liveness: whatever still exists is retained or carried (pinned) for later.
        assert stored <= kept | set(carried), stored - kept - set(carried)
        assert set(carried) <= pinned
    # With no pending checkpoint at the end, exactly the retained objects remain.
    assert stored == {k for r in retained for k in r.keys}
    assert carried == ()


# --------------------------------------------------------------------------- orphan planner

NOW_MS = 1_700_000_000_000
HOUR_MS = 3_600_000


def obj(key: str, created_ms: int | None, size: int = 10) -> ListedObject:
    return ListedObject(key, size, created_ms)


def test_orphans_are_unreferenced_and_older_than_the_grace_period() -> None:
    listed = [
        obj("dstl/old-referenced", NOW_MS - 2 * HOUR_MS),
        obj("dstl/old-orphan", NOW_MS - 2 * HOUR_MS, size=7),
        obj("snapshots/op/old-orphan", NOW_MS - HOUR_MS, size=5),  # exactly at the cutoff
        obj("dstl/young", NOW_MS - HOUR_MS + 1),
        obj("dstl/from-the-future", NOW_MS + HOUR_MS),  # a writer's clock runs ahead
        obj("dstl/unnamed", None),
        obj("dstl/unnamed-referenced", None),
        obj("dstl/young-referenced", NOW_MS),
    ]
    referenced = {"dstl/old-referenced", "dstl/unnamed-referenced", "dstl/young-referenced",
                  "dstl/not-listed"}
    plan = plan_orphans(listed, referenced, now_ms=NOW_MS, grace_ms=HOUR_MS)
    assert plan == OrphanPlan(
        delete=("dstl/old-orphan", "snapshots/op/old-orphan"),
        referenced=("dstl/old-referenced", "dstl/unnamed-referenced", "dstl/young-referenced"),
        too_young=("dstl/from-the-future", "dstl/young"),
        unnamed=("dstl/unnamed",),
        cutoff_ms=NOW_MS - HOUR_MS,
        delete_bytes=12)


def test_orphans_with_no_grace_period_and_an_empty_listing() -> None:
    plan = plan_orphans([obj("dstl/a", NOW_MS), obj("dstl/a", NOW_MS)], set(), now_ms=NOW_MS,
                        grace_ms=0)
    assert plan.delete == ("dstl/a",) and plan.delete_bytes == 10  # listed twice, counted once
    empty = plan_orphans([], {"dstl/a"}, now_ms=NOW_MS, grace_ms=HOUR_MS)
    assert empty == OrphanPlan((), (), (), (), NOW_MS - HOUR_MS, 0)


def test_listed_objects_take_their_creation_time_from_the_name() -> None:
    seg = segment_key(0x18F00000000, "a1b2c3d4e5f6", 1, 0)
    assert ListedObject.of(seg, 42) == ListedObject(seg, 42, 0x18F00000000)
    assert ListedObject.of("snapshots/count/18f00000002-0003.snap", 1).created_ms == 0x18F00000002
    assert ListedObject.of("dstl/unparseable-name.seg", 1).created_ms is None


@pytest.mark.parametrize("listed,now_ms,grace_ms,match", [
    ([], NOW_MS, -1, "grace_ms=-1"),
    ([], NOW_MS, 1.5, "grace_ms=1.5 must be an integer"),
    ([], NOW_MS, True, "grace_ms=True must be an integer"),
    ([], float(NOW_MS), 0, "now_ms=.* must be an integer"),
    ([obj(manifest_key(1, 1), 0)], NOW_MS, 0, "checkpoints/.* are not below dstl/"),
    ([obj("elsewhere/x", 0)], NOW_MS, 0, "elsewhere/x"),
])
def test_orphan_planner_rejects_bad_input(listed: list[ListedObject], now_ms: int, grace_ms: int,
                                          match: str) -> None:
    with pytest.raises(UsageError, match=match):
        plan_orphans(listed, set(), now_ms=now_ms, grace_ms=grace_ms)


_created = st.one_of(st.none(), st.integers(NOW_MS - 10 * HOUR_MS, NOW_MS + HOUR_MS))


@given(st.data())
def test_orphan_planner_selects_exactly_the_old_unreferenced_keys(data: st.DataObject) -> None:
    drawn = data.draw(st.lists(st.tuples(st.integers(0, 1 << 20), _created), max_size=30),
                      label="(size, created_ms) per object")
    keys = [f"{'dstl/' if i % 3 else 'snapshots/op/'}{i:04d}" for i in range(len(drawn))]
    listed = [ListedObject(k, size, created) for k, (size, created) in zip(keys, drawn)]
    referenced = set(data.draw(st.lists(st.sampled_from(keys)), label="referenced")
                     if keys else [])
    referenced |= set(data.draw(st.lists(st.sampled_from(["dstl/gone", "snapshots/gone"])),
                                label="referenced, not listed"))
    grace_ms = data.draw(st.integers(0, 5 * HOUR_MS), label="grace_ms")
    plan = plan_orphans(listed, frozenset(referenced), now_ms=NOW_MS, grace_ms=grace_ms)
    by_key = {o.key: o for o in listed}

    def old_enough(o: ListedObject) -> bool:
        return o.created_ms is not None and NOW_MS - o.created_ms >= grace_ms

    # Safety: never a referenced key, never one younger than the grace period or without a time.
    assert not set(plan.delete) & referenced
    assert all(old_enough(by_key[k]) for k in plan.delete)
    # Liveness: every other unreferenced key is selected.
    assert set(plan.delete) == {k for k, o in by_key.items()
                                if k not in referenced and old_enough(o)}
    # Every listed key is in exactly one group, each group sorted, and the reasons hold.
    groups = (plan.delete, plan.referenced, plan.too_young, plan.unnamed)
    assert sorted(k for g in groups for k in g) == sorted(keys)
    assert all(list(g) == sorted(g) for g in groups)
    assert set(plan.referenced) == referenced & set(keys)
    assert all(by_key[k].created_ms is None for k in plan.unnamed)
    assert all(not old_enough(by_key[k]) for k in plan.too_young)
    assert plan.delete_bytes == sum(by_key[k].size for k in plan.delete)
    assert plan.cutoff_ms == NOW_MS - grace_ms
