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

**Orphans** (:func:`plan_orphans`) are what no plan will ever delete: uploads of aborted batches
and failed tasks, objects whose delete a crash interrupted. Here, and only here, time matters: an
object no checkpoint references may still be an upload of a live writer whose task has not
acknowledged it yet, so only objects whose name says they were created at least a grace period
ago are selected. Fed with the listed objects (key, size, creation time from the name), the keys
retained and pending checkpoints reference, ``now`` and the grace period, it returns what to
delete and, for every other object, why it stays: referenced, too young, or no creation time in
its name (such an object is never guessed at).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from dstl.errors import UsageError
from dstl.layout import REFERENCE_PREFIXES, created_ms_of, manifest_key

__all__ = ["CheckpointRefs", "ListedObject", "OrphanPlan", "RetentionPlan", "plan_orphans",
           "plan_retention"]


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
    _check_retention_inputs(retained, completed, retain)
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


def _check_retention_inputs(retained: Sequence[CheckpointRefs], completed: CheckpointRefs,
                            retain: int) -> None:
    if not isinstance(retain, int) or isinstance(retain, bool) or retain < 1:
        raise UsageError(f"plan_retention: retain={retain!r} must be an integer >= 1")
    ids = [r.checkpoint_id for r in retained]
    if len(set(ids)) != len(ids):
        raise UsageError(f"plan_retention: retained names a checkpoint id twice: {sorted(ids)}")
    newest = max((r.order for r in retained), default=None)
    if newest is not None and completed.order <= newest:
        raise UsageError(f"plan_retention: completed checkpoint {completed.order} is not newer "
                         f"than the newest retained checkpoint {newest}")


# --------------------------------------------------------------------------- orphans


@dataclass(frozen=True, slots=True)
class ListedObject:
    """One listed segment or snapshot, as the orphan planner sees it.

    Attributes:
        key: the object key (below ``dstl/`` or ``snapshots/``).
        size: its size in bytes.
        created_ms: its creation time (epoch ms) as its name states it, or ``None`` when the
            name carries none (see :func:`dstl.layout.created_ms_of`).
    """

    key: str
    size: int
    created_ms: int | None

    @classmethod
    def of(cls, key: str, size: int) -> ListedObject:
        """The object ``key`` of ``size`` bytes, its creation time read from its name."""
        return cls(key, size, created_ms_of(key))


@dataclass(frozen=True, slots=True)
class OrphanPlan:
    """What orphan collection deletes, and why every other listed object stays
    (see :func:`plan_orphans`). Every tuple is sorted; each listed key is in exactly one.

    Attributes:
        delete: orphans: no retained or pending checkpoint references them, and their names
            say they were created at or before ``cutoff_ms``.
        referenced: kept: a retained or pending checkpoint references them.
        too_young: kept for now: unreferenced, but created after ``cutoff_ms`` (possibly an
            upload of a live writer that no task has acknowledged yet).
        unnamed: left alone: unreferenced, and the name carries no creation time.
        cutoff_ms: ``now_ms - grace_ms``.
        delete_bytes: the total size of ``delete``.
    """

    delete: tuple[str, ...]
    referenced: tuple[str, ...]
    too_young: tuple[str, ...]
    unnamed: tuple[str, ...]
    cutoff_ms: int
    delete_bytes: int


def plan_orphans(listed: Iterable[ListedObject], referenced: Collection[str], *, now_ms: int,
                 grace_ms: int) -> OrphanPlan:
    """Select the orphans among ``listed``. Pure.

    An object is selected iff no retained or pending checkpoint references it and its name
    says it was created at least ``grace_ms`` before ``now_ms``. A name without a creation time
    is never selected, and neither is a name from the future (clock skew: it is too young).

    Args:
        listed: the objects under ``dstl/`` and ``snapshots/`` (a key listed twice counts once).
        referenced: every key a retained or pending checkpoint references.
        now_ms: the current epoch time in ms.
        grace_ms: the grace period in ms (>= 0). It must exceed the longest time from an
            upload to the acknowledgement that first references it, plus the clock skew
            between the writers and the caller.

    Returns:
        The plan.

    Raises:
        UsageError: ``grace_ms`` or ``now_ms`` is not an integer, ``grace_ms`` < 0, or a listed
            key lies outside ``dstl/`` and ``snapshots/`` (only segments and snapshots can be
            orphans; a manifest never is).
    """
    for name, value in (("now_ms", now_ms), ("grace_ms", grace_ms)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise UsageError(f"plan_orphans: {name}={value!r} must be an integer (ms)")
    if grace_ms < 0:
        raise UsageError(f"plan_orphans: grace_ms={grace_ms} must be >= 0")
    cutoff_ms = now_ms - grace_ms
    by_key = {obj.key: obj for obj in listed}
    outside = sorted(k for k in by_key if not k.startswith(REFERENCE_PREFIXES))
    if outside:
        raise UsageError(f"plan_orphans: {outside[:5]} are not below "
                         f"{' or '.join(REFERENCE_PREFIXES)}; list those prefixes only")
    kept = sorted(k for k in by_key if k in referenced)
    unreferenced = [by_key[k] for k in sorted(by_key) if k not in referenced]
    unnamed = tuple(o.key for o in unreferenced if o.created_ms is None)
    old = [o for o in unreferenced if o.created_ms is not None and o.created_ms <= cutoff_ms]
    young = tuple(o.key for o in unreferenced
                  if o.created_ms is not None and o.created_ms > cutoff_ms)
    return OrphanPlan(delete=tuple(o.key for o in old), referenced=tuple(kept),
                      too_young=young, unnamed=unnamed, cutoff_ms=cutoff_ms,
                      delete_bytes=sum(o.size for o in old))
