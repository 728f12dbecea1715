"""The retention planner — which checkpoints a completion keeps, and what may be deleted. Pure.

Theory of operation
-------------------
**Retention** (:func:`plan_retention`) is by checkpoint id, never by wall-clock time. Given the
retained checkpoints, the key sets of pending (in-flight) checkpoints and a new completion, it
keeps the newest ``retain`` checkpoint ids (a new attempt of a retained id *replaces* the older
attempt), and says which manifests to delete (every subsumed one) and which objects to delete:
exactly those referenced by a subsumed checkpoint (or left over from an earlier plan) that NO
retained and NO pending checkpoint references. Keys protected only by a pending checkpoint are
returned as ``deferred_objects`` for the caller to pass back in next time, so nothing unreferenced
stays once the pending checkpoint is gone (G5). The caller deletes manifests first, then objects:
a crash in between leaves only orphans, never a manifest naming deleted data.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from dstl.errors import UsageError
from dstl.layout import manifest_key

__all__ = ["CheckpointRefs", "RetentionPlan", "plan_retention"]


@dataclass(frozen=True, slots=True)
class CheckpointRefs:
    """What the retention planner needs to know about a checkpoint: its name and its keys."""

    checkpoint_id: int
    attempt: int
    keys: frozenset[str]

    @property
    def manifest_key(self) -> str:
        return manifest_key(self.checkpoint_id, self.attempt)

    @property
    def order(self) -> tuple[int, int]:
        return (self.checkpoint_id, self.attempt)


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    """What a completion changes (see :func:`plan_retention`).

    Attributes:
        retained: the checkpoints to keep, oldest first; the new completion is last.
        subsumed: checkpoints dropped by this completion, oldest first (including an older
            attempt of the completed checkpoint id, which the new attempt replaces).
        delete_manifests: manifest keys to delete — FIRST.
        delete_objects: object keys to delete after the manifests, sorted: no retained and no
            pending checkpoint references them.
        deferred_objects: keys that would be deleted but a pending checkpoint references them;
            pass them back as ``doomed_objects`` on the next plan.
    """

    retained: tuple[CheckpointRefs, ...]
    subsumed: tuple[CheckpointRefs, ...]
    delete_manifests: tuple[str, ...]
    delete_objects: tuple[str, ...]
    deferred_objects: tuple[str, ...]


def plan_retention(retained: Sequence[CheckpointRefs], completed: CheckpointRefs, *,
                   retain: int, pending: Iterable[Collection[str]] = (),
                   doomed_objects: Iterable[str] = ()) -> RetentionPlan:
    """Decide what a completed checkpoint subsumes and what may be deleted. Pure.

    Rules: a new attempt of a retained checkpoint id replaces the older attempt; then the newest
    ``retain`` checkpoint ids stay and the rest are subsumed. An object is deleted iff it is
    referenced by a subsumed checkpoint or listed in ``doomed_objects``, and by no retained and no
    pending checkpoint. Time plays no part.

    Args:
        retained: the currently retained checkpoints (any order).
        completed: the checkpoint just committed; it must be newer than every retained one
            (same id with a higher attempt counts as newer).
        retain: how many checkpoint ids to keep (>= 1).
        pending: the key sets of in-flight checkpoints (what their tasks acknowledged so far).
        doomed_objects: keys left over from earlier plans (deferred, or whose deletion failed).

    Returns:
        The plan.

    Raises:
        UsageError: ``retain`` < 1, ``completed`` is not newer than every retained checkpoint,
            or ``retained`` names one checkpoint id twice.
    """
    if not isinstance(retain, int) or isinstance(retain, bool) or retain < 1:
        raise UsageError(f"plan_retention: retain={retain!r} must be an integer >= 1")
    ids = [r.checkpoint_id for r in retained]
    if len(set(ids)) != len(ids):
        raise UsageError(f"plan_retention: retained names a checkpoint id twice: {sorted(ids)}")
    newest = max((r.order for r in retained), default=None)
    if newest is not None and completed.order <= newest:
        raise UsageError(f"plan_retention: completed checkpoint {completed.order} is not newer "
                         f"than the newest retained checkpoint {newest}")
    replaced = [r for r in retained if r.checkpoint_id == completed.checkpoint_id]
    kept = [*sorted((r for r in retained if r.checkpoint_id != completed.checkpoint_id),
                    key=lambda r: r.order), completed]
    subsumed = sorted(kept[:-retain] + replaced, key=lambda r: r.order)
    kept = kept[-retain:]
    retained_refs = frozenset().union(*(r.keys for r in kept))
    pending_refs = frozenset().union(*(frozenset(p) for p in pending))
    candidates = frozenset().union(*(r.keys for r in subsumed)) | frozenset(doomed_objects)
    unreferenced = candidates - retained_refs
    return RetentionPlan(
        retained=tuple(kept),
        subsumed=tuple(subsumed),
        delete_manifests=tuple(r.manifest_key for r in subsumed),
        delete_objects=tuple(sorted(unreferenced - pending_refs)),
        deferred_objects=tuple(sorted(unreferenced & pending_refs)),
    )
