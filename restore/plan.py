"""``plan_restore``: what a restore reads, and in which order — decided from the handles alone.

Pure: no I/O, no threads. :func:`restore.restore.restore_backend` executes the plan.

Theory of operation
-------------------
A restore of the key groups ``K`` from backend handles must give every key group the state the
handles describe for it, applying each change set to it exactly once and in causal order,
whatever handles are passed: one checkpoint's handles after any sequence of rescales, the same
handle twice, two checkpoints of one backend.

*Items and histories.* A handle covers only its own range (a backend owns nothing else; handles
written before restored logs were trimmed name whole older logs, of which only this range is
theirs). For a key group ``k`` it covers, the handle's *history* of ``k`` is the sequence of its
items that stand for ``k``, in the handle's order: the snapshot references whose range holds
``k``, then the change sets of the changelog handles whose replay range (the writer's range, or
its restriction) holds ``k``. A snapshot item is named by its object key; a change set by
``(log id, sqn, segment key, offset)`` — log ids repeat across generations (the Spark operator
reuses ``<name>/p<N>`` and every new writer starts at sqn 0), so log id and sqn alone do not name
one; the object position does, and every handle naming a change set names the same one.

*Choice.* The handles covering ``k`` must tell the same history of it, or earlier parts of it
(an older checkpoint of the same backend, an empty handle, the same handle again); the longest
is ``k``'s history. Anything else describes two different states (another job's handle, or two
checkpoints with a materialization between them): refused with :class:`UsageError` naming the
key groups and the handles. Histories only change where some range starts or ends, so they are
computed once per elementary interval of ``K``, not per key group.

*Pieces.* A key group's history starts with at most one full snapshot, which deltas may follow
(incremental materializations: each applies on the piece before it); the plan lists every
snapshot reference in first-use order, so a delta comes after the pieces it applies on.

*Order.* A backend's handle lists its snapshots, then its restored logs in the order its own
restore replayed them, then its own log (``materializer.backend``: ``restored_log + (delta,)``);
so in every history an older change set precedes a newer one. The plan replays each change set
once, for the union of the key groups whose history holds it, in a topological order of
"follows in some history" (ties: first appearance in the handles); two histories ordering two
change sets differently are refused. Consecutive change sets of one log with the same key
groups form one changelog handle, restricted to each contiguous run of those key groups; these
handles are also what the restored backend keeps referencing (its share, nothing more).
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

from dstl.errors import UsageError
from dstl.handle import ChangelogHandle, ChangeSetRef
from dstl.keygroups import KeyGroupRange
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef

__all__ = ["RestorePlan", "plan_restore"]

#: ``("s", key)`` for a snapshot object, ``("c", log id, sqn, segment key, offset)`` for a change
#: set: what a history is made of.
_Id = tuple[Hashable, ...]


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """What one restore reads, decided from the handles alone (no I/O).

    Attributes:
        operator_id: the restored backend's id.
        max_parallelism: the job's number of key groups (the handles' own).
        key_groups: the restored backend's range.
        checkpoint: the checkpoint id(s) of the handles, for messages (``"?"`` without handles).
        snapshots: the snapshot references to load, each restricted to the key groups it is
            loaded for (an object appears once per contiguous run of them), in first-use order
            (a delta after the pieces it applies on).
        logs: the changelog handles to replay after the snapshots, in replay order, each
            restricted to the key groups it is replayed for; every change set is applied to
            every key group at most once.
        materialization_id: the newest materialization among the handles.
    """

    operator_id: str
    max_parallelism: int
    key_groups: KeyGroupRange
    checkpoint: str
    snapshots: tuple[SnapshotRef, ...]
    logs: tuple[ChangelogHandle, ...]
    materialization_id: int


def plan_restore(handles: Sequence[ChangelogStateBackendHandle], key_groups: KeyGroupRange, *,
                 operator_id: str | None = None,
                 max_parallelism: int | None = None) -> RestorePlan:
    """Decide what a restore of ``key_groups`` from ``handles`` reads (see the module docstring).

    Args:
        handles: backend handles (parsed), any order, repeats allowed.
        key_groups: the restored backend's range (rescaling: any range).
        operator_id: default: the handles' id, when they agree.
        max_parallelism: default: the handles' value (they must agree).

    Raises:
        UsageError: the operator id or max parallelism cannot be inferred, ``max_parallelism``
            differs from the handles' (key groups cannot be remapped), or the handles disagree
            about the history of some key group (names them and the key groups).
    """
    parts = [p for p in (_Part.of(h, key_groups) for h in handles) if p is not None]
    index = _Index.of(parts)
    chosen = [(i, _choose(parts, i)) for i in _intervals(parts, key_groups)]
    covered: dict[_Id, list[KeyGroupRange]] = defaultdict(list)
    for interval, history in chosen:
        for item in history:
            covered[item].append(interval)
    order = _causal_order([[x for x in h if x[0] == "c"] for _, h in chosen], index.rank)
    return RestorePlan(
        operator_id=_operator_id(handles, operator_id),
        max_parallelism=_max_parallelism(handles, max_parallelism),
        key_groups=key_groups,
        checkpoint=",".join(sorted({str(h.checkpoint_id) for h in handles})) or "?",
        snapshots=_snapshot_refs(index, covered),
        logs=_log_runs(order, index, covered),
        materialization_id=max((h.materialization_id for h in handles), default=0))


# --------------------------------------------------------------------------- histories


@dataclass(frozen=True, slots=True)
class _Part:
    """A handle cut to the restored range: its range there and its items standing for it."""

    handle: ChangelogStateBackendHandle
    key_groups: KeyGroupRange
    snapshots: tuple[SnapshotRef, ...]
    logs: tuple[ChangelogHandle, ...]

    @classmethod
    def of(cls, h: ChangelogStateBackendHandle, target: KeyGroupRange) -> _Part | None:
        own = h.key_groups.intersection(target)
        if not len(own):
            return None
        snapshots = (s.restricted(own) for s in h.materialized)
        logs = (c.restricted(own) for c in h.non_materialized)
        return cls(h, own, tuple(s for s in snapshots if s is not None),
                   tuple(c for c in logs if c is not None))

    def history(self, interval: KeyGroupRange) -> list[_Id]:
        """The items standing for ``interval`` (inside one range or outside it), in order, each
        once."""
        k = interval.start
        items: list[_Id] = [_snapshot_id(s) for s in self.snapshots if k in s.key_groups]
        for log in self.logs:
            if k in log.replay_key_groups:
                items.extend(_change_set_id(log, r) for r in log.change_sets)
        return list(dict.fromkeys(items))

    def describe(self) -> str:
        h = self.handle
        return f"handle of {h.operator_id!r} {h.key_groups} (checkpoint {h.checkpoint_id})"


def _snapshot_id(ref: SnapshotRef) -> _Id:
    return ("d" if ref.delta else "s", ref.key)


def _change_set_id(log: ChangelogHandle, ref: ChangeSetRef) -> _Id:
    return ("c", log.log_id, ref.sqn, ref.key, ref.offset)


@dataclass(slots=True)
class _Index:
    """Every item of the handles: its reference, its log, its first appearance."""

    snapshots: dict[str, SnapshotRef] = field(default_factory=dict)
    change_sets: dict[_Id, tuple[ChangeSetRef, ChangelogHandle]] = field(default_factory=dict)
    rank: dict[_Id, int] = field(default_factory=dict)

    @classmethod
    def of(cls, parts: Sequence[_Part]) -> _Index:
        """Index the items; two handles naming one item differently are refused."""
        index = cls()
        for p in parts:
            for s in p.snapshots:
                seen = index.snapshots.setdefault(s.key, s)
                if (seen.size, seen.materialization_id, seen.delta) != (
                        s.size, s.materialization_id, s.delta):
                    raise UsageError(f"handles disagree about snapshot {s.key}: size "
                                     f"{seen.size} vs {s.size}; pass the handles of one job")
            for log in p.logs:
                for r in log.change_sets:
                    cid = _change_set_id(log, r)
                    seen_ref, seen_log = index.change_sets.setdefault(cid, (r, log))
                    if seen_ref != r or seen_log.key_groups != log.key_groups:
                        raise UsageError(f"handles disagree about change set ({log.log_id!r}, "
                                         f"sqn {r.sqn}) at {r.key}@{r.offset}; pass the "
                                         "handles of one job")
                    index.rank.setdefault(cid, len(index.rank))
        return index


def _intervals(parts: Sequence[_Part], target: KeyGroupRange) -> list[KeyGroupRange]:
    """``target`` cut at every boundary of every range in the parts."""
    cuts = {target.start, target.end + 1}
    for p in parts:
        for r in (p.key_groups, *(s.key_groups for s in p.snapshots),
                  *(c.replay_key_groups for c in p.logs)):
            cuts.update((r.start, r.end + 1))
    points = sorted(c for c in cuts if target.start <= c <= target.end + 1)
    return [KeyGroupRange(a, b - 1) for a, b in itertools.pairwise(points)]


def _choose(parts: Sequence[_Part], interval: KeyGroupRange) -> list[_Id]:
    """The history of ``interval``: the longest a covering handle tells, which every other one
    must begin with."""
    told = [(p, p.history(interval)) for p in parts if interval.start in p.key_groups]
    if not told:
        return []
    best_part, best = max(told, key=lambda t: len(t[1]))
    for p, h in told:
        if best[:len(h)] != h:
            at = next(i for i, (a, b) in enumerate(zip(h, best, strict=False)) if a != b)
            raise UsageError(
                f"handles disagree about key groups {interval}: {p.describe()} and "
                f"{best_part.describe()} differ at item {at} ({_describe(h[at])} vs "
                f"{_describe(best[at])}); they describe different states — pass the handles of "
                "one checkpoint of one job")
    pieces = [x[0] for x in best if x[0] != "c"]
    if pieces and (pieces[0] != "s" or "s" in pieces[1:]):
        raise UsageError(f"{best_part.describe()} names several snapshots for key groups "
                         f"{interval}, or a delta without the full snapshot before it; a "
                         "snapshot reference must not overlap another, except by the deltas "
                         "that follow it")
    return best


def _describe(item: _Id) -> str:
    if item[0] == "s":
        return f"snapshot {item[1]}"
    if item[0] == "d":
        return f"delta {item[1]}"
    return f"change set ({item[1]!r}, sqn {item[2]}) at {item[3]}@{item[4]}"


def _causal_order(histories: Sequence[Sequence[_Id]], rank: dict[_Id, int]) -> list[_Id]:
    """Every change set once, each history's order kept; ties by first appearance."""
    succ: dict[_Id, set[_Id]] = defaultdict(set)
    preds: dict[_Id, int] = defaultdict(int)
    nodes: set[_Id] = set()
    for h in histories:
        nodes.update(h)
        for a, b in itertools.pairwise(h):
            if b not in succ[a]:
                succ[a].add(b)
                preds[b] += 1
    ready = [(rank[n], n) for n in nodes if not preds[n]]
    heapq.heapify(ready)
    out: list[_Id] = []
    while ready:
        _, n = heapq.heappop(ready)
        out.append(n)
        for m in succ[n]:
            preds[m] -= 1
            if not preds[m]:
                heapq.heappush(ready, (rank[m], m))
    if len(out) != len(nodes):
        raise UsageError("handles order change sets inconsistently (one history applies A "
                         "before B, another B before A); pass the handles of one checkpoint")
    return out


# --------------------------------------------------------------------------- the plan's parts


def _merged(intervals: Sequence[KeyGroupRange]) -> tuple[KeyGroupRange, ...]:
    """Ascending, disjoint intervals joined where they touch."""
    out: list[KeyGroupRange] = []
    for r in intervals:
        if out and out[-1].end + 1 == r.start:
            out[-1] = KeyGroupRange(out[-1].start, r.end)
        else:
            out.append(r)
    return tuple(out)


def _snapshot_refs(index: _Index, covered: dict[_Id, list[KeyGroupRange]]
                   ) -> tuple[SnapshotRef, ...]:
    out: list[SnapshotRef] = []
    for ref in index.snapshots.values():
        for r in _merged(covered.get(_snapshot_id(ref), [])):
            out.append(ref if ref.key_groups == r else replace(ref, key_groups=r))
    return tuple(out)


def _log_runs(order: Sequence[_Id], index: _Index, covered: dict[_Id, list[KeyGroupRange]]
              ) -> tuple[ChangelogHandle, ...]:
    """The change sets in ``order`` as changelog handles: one per run of consecutive change
    sets of one log with the same key groups, and per contiguous range of those."""
    out: list[ChangelogHandle] = []
    run: list[ChangeSetRef] = []
    run_log: ChangelogHandle | None = None
    run_ranges: tuple[KeyGroupRange, ...] = ()
    for cid in order:
        ref, log = index.change_sets[cid]
        ranges = _merged(covered[cid])
        if (run_log is not None and log.log_id == run_log.log_id
                and log.key_groups == run_log.key_groups and ranges == run_ranges
                and ref.sqn == run[-1].sqn + 1):
            run.append(ref)
            continue
        if run_log is not None:
            out.extend(_restricted_runs(run_log, run, run_ranges))
        run, run_log, run_ranges = [ref], log, ranges
    if run_log is not None:
        out.extend(_restricted_runs(run_log, run, run_ranges))
    return tuple(out)


def _restricted_runs(log: ChangelogHandle, refs: Sequence[ChangeSetRef],
                     ranges: Sequence[KeyGroupRange]) -> list[ChangelogHandle]:
    """``refs`` (consecutive sqns of ``log``'s writer) once per range; ``log`` itself when it is
    exactly that."""
    out = []
    for r in ranges:
        if log.change_sets == tuple(refs) and log.replay_key_groups == r:
            out.append(log)
        else:
            out.append(ChangelogHandle(log.log_id, log.key_groups, refs[0].sqn, refs[-1].sqn + 1,
                                       tuple(refs), 0, r))
    return out


# --------------------------------------------------------------------------- ids and parallelism


def _operator_id(handles: Sequence[ChangelogStateBackendHandle], given: str | None) -> str:
    if given is not None:
        return given
    ids = {h.operator_id for h in handles}
    if len(ids) != 1:
        raise UsageError(f"cannot infer operator_id from handles of {sorted(ids)}; pass "
                         "operator_id=")
    return ids.pop()


def _max_parallelism(handles: Sequence[ChangelogStateBackendHandle], given: int | None) -> int:
    mps = {h.max_parallelism for h in handles}
    if given is None:
        if len(mps) != 1:
            raise UsageError(f"handles disagree on max_parallelism ({sorted(mps)}); pass "
                             "max_parallelism=")
        return mps.pop()
    if mps and mps != {given}:
        raise UsageError(f"handles were written with max_parallelism {sorted(mps)}, not "
                         f"{given}: key groups cannot be remapped")
    return given
