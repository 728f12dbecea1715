"""What a read does, decided from manifests alone: the splits of a state read and of a change
feed. Pure — values in, values out; the one fact that needs a read (a snapshot's boundary) comes
through a callback.

State splits
------------
One split per task of the checkpoint (one backend handle = one key-group range), or per slice of
``max_key_groups`` key groups of one, so a large state reads in parallel. A key filter becomes a
set of key groups (``key_group_for`` of each key); then only the runs of wanted key groups inside
each handle's range are splits, and a handle that holds none of them is not read at all.

Change feed
-----------
Between checkpoints ``a`` (exclusive) and ``b`` the feed walks the retained checkpoints
``a < c1 < ... < b`` in order. A change set is named by ``(segment key, offset)`` (unique in the
store: segment names are written once); it belongs to the **first** checkpoint whose handles name
it. So for ``ci`` the new change sets of a task are those of its handle not named by ``a`` or any
earlier ``cj`` — in a handle they form a suffix (its older sets were checkpointed before), read
as *runs* ``[start, end)`` of ``change_sets``. Log order per key is sqn order inside a handle, and
the handles of a backend's checkpoint are in replay order (restored logs first, then the
writer's own), so older writers come before newer ones after a rescale.

A **materialization** can cut changes out of the log: a backend snapshots its table at its
current sqn, and change sets written after the last checkpoint but before that cut are in the
snapshot yet in no checkpoint's log. The feed detects it per task: a snapshot that first appears
in ``ci`` is *gap-free* only when its boundary — the last change set it reflects, recorded by
snapshots taken at a checkpoint boundary (the executor agent's) — was named by an earlier
checkpoint. Otherwise the split carries a :class:`GapFill`: the state at the previous checkpoint
and the snapshot cut are restored and their difference is emitted (as whole-value ``set`` and
``clear`` rows marked ``source="snapshot"``) before the split's own runs. A feed that starts
from no checkpoint (``start=None``) is the same case against an empty state: the first
checkpoint's snapshots come out as differences, its log as changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from dstl.handle import ChangelogHandle
from dstl.keygroups import KeyGroupRange
from dstl.reader.catalog import TaskState
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef

__all__ = ["ChangeSplit", "CheckpointView", "GapFill", "LogRun", "StateSplit",
           "plan_changes", "plan_state_splits"]

#: ``boundary(snapshot)`` -> the ``(segment key, offset)`` of the last change set the snapshot
#: reflects, or ``None`` when the snapshot does not record one.
BoundaryOf = Callable[[SnapshotRef], "tuple[str, int] | None"]


@dataclass(frozen=True, slots=True)
class StateSplit:
    """One unit of a state read: one task's handle, restricted to ``key_groups``.

    Attributes:
        checkpoint_id: the checkpoint read.
        task_id: the task (under Spark ``p<N>``).
        handle: the task's backend handle, JSON (small and picklable; travels to executors).
        key_groups: ``(start, end)``, inclusive, inside the handle's range.
    """

    checkpoint_id: int
    task_id: str
    handle: str
    key_groups: tuple[int, int]

    @property
    def key_group_range(self) -> KeyGroupRange:
        return KeyGroupRange(*self.key_groups)


def plan_state_splits(checkpoint_id: int, tasks: Sequence[TaskState], *,
                      key_groups: Iterable[int] | None = None,
                      max_key_groups: int | None = None) -> list[StateSplit]:
    """The splits of a state read of one checkpoint (see the module docstring).

    Args:
        checkpoint_id: the checkpoint.
        tasks: its tasks' handles.
        key_groups: read only these key groups (a pushed-down key or key-group filter);
            ``None``: all.
        max_key_groups: at most this many key groups per split (``None``: one split per task).
    """
    wanted = None if key_groups is None else sorted(set(key_groups))
    out: list[StateSplit] = []
    for t in tasks:
        rng = t.handle.key_groups
        runs = [(rng.start, rng.end)] if wanted is None else _runs(k for k in wanted if k in rng)
        for start, end in runs:
            step = max_key_groups or (end - start + 1)
            for s in range(start, end + 1, step):
                out.append(StateSplit(checkpoint_id, t.task_id, t.handle.to_json(),
                                      (s, min(end, s + step - 1))))
    return out


def _runs(sorted_kgs: Iterable[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive key groups, as inclusive ranges."""
    runs: list[tuple[int, int]] = []
    for kg in sorted_kgs:
        if runs and runs[-1][1] == kg - 1:
            runs[-1] = (runs[-1][0], kg)
        else:
            runs.append((kg, kg))
    return runs


# --------------------------------------------------------------------------- change feed


@dataclass(frozen=True, slots=True)
class CheckpointView:
    """A checkpoint as the change planner needs it: its id and its tasks' handles."""

    checkpoint_id: int
    tasks: tuple[TaskState, ...]


@dataclass(frozen=True, slots=True)
class LogRun:
    """New change sets of one changelog handle: ``change_sets[start:end]``.

    Attributes:
        handle: the :class:`~dstl.handle.ChangelogHandle` JSON (the whole handle: a change whose
            state's metadata record lies in an earlier set of it can still be decoded).
        start, end: the run, as indexes into its ``change_sets``.
    """

    handle: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class GapFill:
    """Changes a materialization cut out of the log, to be recovered as a state difference.

    Attributes:
        previous_checkpoint: the checkpoint before (``-1``: the empty state).
        previous: the previous checkpoint's backend handles (JSON) that meet the split's key
            groups.
        cut: the split's handle with its snapshots only (JSON): the state at the cut.
    """

    previous_checkpoint: int
    previous: tuple[str, ...]
    cut: str


@dataclass(frozen=True, slots=True)
class ChangeSplit:
    """The changes one task's backend made in one checkpoint.

    Attributes:
        checkpoint_id: the checkpoint the changes belong to.
        task_id: the task.
        key_groups: ``(start, end)``: the task's range (changes of other key groups in shared
            change sets are another task's).
        runs: the new change sets, in log order.
        gap: a state difference to emit first, or ``None``.
        only: read only these key groups (a pushed-down filter), or ``None``.
    """

    checkpoint_id: int
    task_id: str
    key_groups: tuple[int, int]
    runs: tuple[LogRun, ...]
    gap: GapFill | None = None
    only: tuple[int, ...] | None = None


def plan_changes(start: CheckpointView | None, checkpoints: Sequence[CheckpointView],
                 boundary: BoundaryOf, *, key_groups: Iterable[int] | None = None
                 ) -> list[ChangeSplit]:
    """The splits of the changes after ``start`` up to the last of ``checkpoints``.

    Args:
        start: the checkpoint the feed starts after (exclusive), or ``None`` for the empty state.
        checkpoints: the checkpoints after it, ascending ids, every one the store retains.
        boundary: reads a snapshot's boundary (called only for snapshots new in a checkpoint).
        key_groups: only these key groups (a pushed-down filter), or ``None``.

    Returns:
        One split per checkpoint and task with new changes, in checkpoint order, then task order.
    """
    wanted = None if key_groups is None else frozenset(key_groups)
    seen: set[tuple[str, int]] = set()
    known_snapshots: set[str] = set()
    previous = start
    if start is not None:
        _remember(start, seen, known_snapshots)
    out: list[ChangeSplit] = []
    for cp in checkpoints:
        for t in cp.tasks:
            rng = t.handle.key_groups
            only = None if wanted is None else tuple(sorted(k for k in wanted if k in rng))
            if only == ():
                continue
            split = _task_split(cp.checkpoint_id, t, previous, seen, known_snapshots, boundary)
            if split is not None:
                out.append(replace(split, only=only))
        _remember(cp, seen, known_snapshots)
        previous = cp
    return out


def _remember(cp: CheckpointView, seen: set[tuple[str, int]], snapshots: set[str]) -> None:
    for t in cp.tasks:
        snapshots.update(s.key for s in t.handle.materialized)
        for h in t.handle.non_materialized:
            seen.update((r.key, r.offset) for r in h.change_sets)


def _task_split(checkpoint_id: int, t: TaskState, previous: CheckpointView | None,
                seen: set[tuple[str, int]], known_snapshots: set[str], boundary: BoundaryOf
                ) -> ChangeSplit | None:
    h = t.handle
    runs = tuple(run for n in h.non_materialized for run in _new_runs(n, seen))
    fresh = [s for s in h.materialized if s.key not in known_snapshots]
    gap = None
    if fresh and not all(_reflects_seen(boundary(s), seen) for s in fresh):
        gap = _gap(h, previous)
    if not runs and gap is None:
        return None
    return ChangeSplit(checkpoint_id, t.task_id, (h.key_groups.start, h.key_groups.end), runs,
                       gap)


def _reflects_seen(b: tuple[str, int] | None, seen: set[tuple[str, int]]) -> bool:
    return b is not None and b in seen


def _new_runs(h: ChangelogHandle, seen: set[tuple[str, int]]) -> list[LogRun]:
    runs: list[LogRun] = []
    js: str | None = None
    i = 0
    refs = h.change_sets
    while i < len(refs):
        if (refs[i].key, refs[i].offset) in seen:
            i += 1
            continue
        j = i
        while j < len(refs) and (refs[j].key, refs[j].offset) not in seen:
            j += 1
        js = js or h.to_json()
        runs.append(LogRun(js, i, j))
        i = j
    return runs


def _gap(h: ChangelogStateBackendHandle, previous: CheckpointView | None) -> GapFill:
    before = () if previous is None else tuple(
        p.handle.to_json() for p in previous.tasks
        if len(p.handle.key_groups.intersection(h.key_groups)))
    cut = replace(h, non_materialized=())
    return GapFill(previous.checkpoint_id if previous is not None else -1, before, cut.to_json())
