"""The checkpoint coordinator's in-memory state: ids, the pending checkpoint, the retained ones.

Theory of operation
-------------------
A :class:`CheckpointLedger` is what the coordinator knows, and the rules that change it (the
coordinator's module docstring, steps 1-4 and 6), with no store call, thread or lock of its own:
:class:`~dstl.checkpoint.coordinator.CheckpointCoordinator` holds the lock, writes the manifest
and calls the ledger on each side of the put.

1. **Ids.** Ids grow strictly when the ledger picks them; an explicit id may repeat the last
   completed one (a re-run) but never go below it. At most one checkpoint is pending: opening
   a new one aborts the pending one.
2. **Attempts.** Every manifest of an id gets the next attempt number, used up even if its put
   fails (write-once names are never reused).
3. **Retention.** After a commit, :func:`~dstl.checkpoint.retention.plan_retention` gives the
   retained checkpoints; the subsumed manifests, the pending one's failed puts and the objects
   nothing retained references go to the :class:`~dstl.checkpoint.deletion.DeletionQueue`.
4. **Aborts.** An aborted checkpoint's failed puts are doomed; its id and reason are remembered
   (the last 16) only to explain a late acknowledgement.

Every method is called with the coordinator's lock held (the deletion queue's sets are read and
changed under the same lock).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dstl.checkpoint.deletion import DeletionQueue
from dstl.checkpoint.manifest import Manifest, TaskEntry, validate_id
from dstl.checkpoint.recovery import StoredManifest
from dstl.checkpoint.retention import plan_retention
from dstl.errors import ClosedError, UsageError
from dstl.layout import MAX_ATTEMPT, MAX_CHECKPOINT_ID

__all__ = ["AbortedCheckpoint", "CheckpointLedger", "Pending", "task_ids"]

logger = logging.getLogger(__name__)

#: How many aborted checkpoint ids are remembered, only to explain a late acknowledgement.
_ABORTED_MEMORY = 16
#: Keys shown in a log line or message before "...".
_LOG_KEYS = 5


@dataclass(frozen=True, slots=True)
class AbortedCheckpoint:
    """A pending checkpoint that was aborted.

    Attributes:
        checkpoint_id: the checkpoint.
        tasks: the tasks it waited for.
        acknowledged: those that had acknowledged.
        reason: why it was aborted.
    """

    checkpoint_id: int
    tasks: tuple[str, ...]
    acknowledged: tuple[str, ...]
    reason: str


@dataclass(slots=True)
class Pending:
    """The checkpoint waiting for its tasks' acknowledgements."""

    checkpoint_id: int
    tasks: tuple[str, ...]
    trigger_mono: float
    trigger_ms: int
    acks: dict[str, tuple[TaskEntry, float]] = field(default_factory=dict)
    #: manifest keys whose put was attempted for this checkpoint and failed (they may exist).
    uncertain_keys: list[str] = field(default_factory=list)
    #: the job's own values for the manifest (``set_properties``)
    properties: dict[str, Any] = field(default_factory=dict)

    def keys(self) -> set[str]:
        return {k for entry, _ in self.acks.values() for k in entry.referenced_keys}


def task_ids(tasks: Iterable[str]) -> tuple[str, ...]:
    """The tasks a trigger waits for, validated: at least one, well-formed, unique."""
    ids = tuple(tasks) if not isinstance(tasks, str) else (tasks,)
    if not ids:
        raise UsageError("trigger: a checkpoint needs at least one task")
    for t in ids:
        validate_id(t, "task_id")
    if len(set(ids)) != len(ids):
        raise UsageError(f"trigger: task ids repeat in {list(ids)[:10]}")
    return ids


class CheckpointLedger:
    """Ids, the pending checkpoint and the retained ones (see the module docstring).

    Args:
        job_id: written into every manifest.
        retain: checkpoint ids kept.
        clock: monotonic seconds (durations, acknowledgement latencies).
        wall_ms: epoch milliseconds (the times written into manifests).
        deletions: where doomed manifests and objects go.
        owner: the coordinator's ``repr``, for the closed error.
    """

    def __init__(self, *, job_id: str, retain: int, clock: Callable[[], float],
                 wall_ms: Callable[[], int], deletions: DeletionQueue,
                 owner: Callable[[], str]) -> None:
        self.job_id = job_id
        self.retain = retain
        self._clock = clock
        self._wall_ms = wall_ms
        self._deletions = deletions
        self._owner = owner
        self.retained: list[Manifest] = []  # oldest first
        self.pending: Pending | None = None
        self.last_id = 0  # highest checkpoint id triggered or found in the store
        self.last_completed: int | None = None
        self._attempts: dict[int, int] = {}  # highest manifest attempt used or seen, per id
        self._aborted: OrderedDict[int, str] = OrderedDict()
        self.closed = False

    # ------------------------------------------------------------------ what it knows

    def check_open(self) -> None:
        """Raises:
            ClosedError: the coordinator is closed."""
        if self.closed:
            raise ClosedError(self._owner(), "recover a new coordinator from the store")

    def latest(self) -> Manifest | None:
        return self.retained[-1] if self.retained else None

    def newest_retained_id(self) -> int:
        """The newest retained checkpoint id, or -1."""
        return self.retained[-1].checkpoint_id if self.retained else -1

    def kept_manifest_keys(self) -> set[str]:
        """Manifests that are not stale: the retained ones and the pending one's failed puts
        (doomed when it ends)."""
        keep = {m.key for m in self.retained}
        if self.pending is not None:
            keep.update(self.pending.uncertain_keys)
        return keep

    def retained_keys(self) -> set[str]:
        return {k for m in self.retained for k in m.referenced_keys}

    def live_keys(self) -> set[str]:
        live = self.retained_keys()
        if self.pending is not None:
            live |= self.pending.keys()
        return live

    # ------------------------------------------------------------------ recovery

    def adopt_recovered(self, stored: Sequence[StoredManifest],
                        loaded: Sequence[Manifest]) -> None:
        """Recovery step 3: the loaded manifests (newest first) become the retained set; every
        other manifest is doomed; ids and attempts continue above every one found."""
        self.retained = list(loaded[::-1])
        keep = {m.key for m in loaded}
        self._deletions.manifests = {s.key for s in stored if s.key not in keep}
        if stored:
            self.last_id = stored[0].checkpoint_id
        for s in stored:
            self._attempts[s.checkpoint_id] = max(s.attempt,
                                                  self._attempts.get(s.checkpoint_id, 0))
        if loaded:
            self.last_completed = loaded[0].checkpoint_id
            self._attempts = {c: a for c, a in self._attempts.items()
                              if c >= loaded[0].checkpoint_id}

    # ------------------------------------------------------------------ the protocol

    def open(self, tasks: tuple[str, ...],
             checkpoint_id: int | None) -> tuple[int, AbortedCheckpoint | None, bool]:
        """Open a pending checkpoint; returns its id, the checkpoint it aborted (if one was
        pending) and whether it is a re-run of the last completed id."""
        cid = self.next_id(checkpoint_id)
        aborted = None
        if self.pending is not None:
            aborted = self.abort(f"superseded by checkpoint {cid}")
        self.pending = Pending(cid, tasks, self._clock(), self._wall_ms())
        self._aborted.pop(cid, None)
        self.last_id = max(self.last_id, cid)
        return cid, aborted, cid == self.last_completed

    def next_id(self, checkpoint_id: int | None) -> int:
        """The id a trigger opens: the next one, or ``checkpoint_id`` if it may be used."""
        if checkpoint_id is None:
            cid = self.last_id + 1
        else:
            if not isinstance(checkpoint_id, int) or isinstance(checkpoint_id, bool) \
                    or not 0 <= checkpoint_id <= MAX_CHECKPOINT_ID:
                raise UsageError(f"trigger: checkpoint_id={checkpoint_id!r} must be an "
                                 f"integer in [0, {MAX_CHECKPOINT_ID}]")
            cid = checkpoint_id
            if self.last_completed is not None and cid < self.last_completed:
                raise UsageError(
                    f"trigger: checkpoint {cid} is below the last completed checkpoint "
                    f"{self.last_completed}; ids only grow (a re-run may repeat "
                    f"{self.last_completed}, or pass checkpoint_id=None)")
        if cid > MAX_CHECKPOINT_ID:
            raise UsageError(f"trigger: checkpoint ids are exhausted ({cid})")
        return cid

    def pending_for(self, checkpoint_id: int, op: str) -> Pending:
        """The pending checkpoint if its id is ``checkpoint_id``.

        Raises:
            UsageError: it is not pending (says whether it was aborted, completed or never
                triggered).
        """
        p = self.pending
        if p is not None and p.checkpoint_id == checkpoint_id:
            return p
        why = self._aborted.get(checkpoint_id) if isinstance(checkpoint_id, int) else None
        if why is not None:
            detail = f"it was aborted ({why})"
        elif self.last_completed is not None and checkpoint_id == self.last_completed:
            detail = "it is already complete (trigger it again to re-run it)"
        else:
            detail = "it was never triggered"
        pending = "none" if p is None else str(p.checkpoint_id)
        raise UsageError(f"{op}: checkpoint {checkpoint_id!r} is not pending (pending: "
                         f"{pending}); {detail}")

    def record_ack(self, checkpoint_id: int, entry: TaskEntry) -> tuple[Pending, float, bool]:
        """Record ``entry`` in the pending checkpoint; returns it, the acknowledgement's
        latency (ms) and whether every task has now acknowledged.

        Raises:
            UsageError: the checkpoint is not pending, the task is not one of its tasks, or a
                referenced object is being deleted right now.
        """
        p = self.pending_for(checkpoint_id, "acknowledge")
        self._check_acknowledgement(p, entry)
        latency_ms = max(0.0, (self._clock() - p.trigger_mono) * 1000.0)
        if entry.task_id in p.acks:
            logger.info("checkpoint %d: task %s acknowledged again; the new "
                        "acknowledgement replaces the earlier one", checkpoint_id, entry.task_id)
        p.acks[entry.task_id] = (entry, latency_ms)
        return p, latency_ms, len(p.acks) >= len(p.tasks)

    def _check_acknowledgement(self, p: Pending, entry: TaskEntry) -> None:
        task_id, checkpoint_id = entry.task_id, p.checkpoint_id
        if task_id not in p.tasks:
            raise UsageError(f"acknowledge: task {task_id!r} is not one of the "
                             f"{len(p.tasks)} tasks of checkpoint {checkpoint_id} "
                             f"({list(p.tasks)[:10]})")
        clash = self._deletions.deleting.intersection(entry.referenced_keys)
        if clash:
            raise UsageError(
                f"acknowledge: task {task_id!r} of checkpoint {checkpoint_id} references "
                f"{sorted(clash)[:_LOG_KEYS]}, which are being deleted because only "
                "subsumed checkpoints referenced them; the task must restore from the "
                "latest checkpoint and re-upload instead of reusing subsumed objects")

    def abort(self, reason: str) -> AbortedCheckpoint:
        """Abort the pending checkpoint (there is one): its failed puts are doomed."""
        p = self.pending
        assert p is not None
        self.pending = None
        self._deletions.manifests.update(p.uncertain_keys)
        aborted = AbortedCheckpoint(p.checkpoint_id, p.tasks, tuple(p.acks), reason)
        self._aborted[p.checkpoint_id] = reason
        while len(self._aborted) > _ABORTED_MEMORY:
            self._aborted.popitem(last=False)
        logger.info("aborted checkpoint %d (%d of %d tasks acknowledged): %s", p.checkpoint_id,
                    len(p.acks), len(p.tasks), reason)
        return aborted

    def next_manifest(self, p: Pending) -> Manifest:
        """The manifest of ``p`` under its next attempt number (used up even if the put fails)."""
        cid = p.checkpoint_id
        attempt = self._attempts.get(cid, 0) + 1
        if attempt > MAX_ATTEMPT:
            raise UsageError(f"checkpoint {cid}: manifest attempts exhausted ({MAX_ATTEMPT})")
        self._attempts[cid] = attempt
        return Manifest.build(
            job_id=self.job_id, checkpoint_id=cid, attempt=attempt,
            created_ms=self._wall_ms(), tasks=[p.acks[t][0] for t in p.tasks],
            trigger_ms=p.trigger_ms,
            duration_ms=max(0.0, (self._clock() - p.trigger_mono) * 1000.0),
            ack_latency_ms={t: p.acks[t][1] for t in p.tasks}, retained=self.retain,
            properties=p.properties)

    def apply_retention(self, p: Pending, manifest: Manifest) -> tuple[Manifest, ...]:
        """Make the in-memory state match the store after ``manifest`` committed; returns the
        subsumed checkpoints."""
        plan = plan_retention([m.refs() for m in self.retained], manifest.refs(),
                              retain=self.retain, doomed_objects=self._deletions.objects)
        by_key = {m.key: m for m in self.retained}
        by_key[manifest.key] = manifest
        self.retained = [by_key[r.manifest_key] for r in plan.retained]
        subsumed = tuple(by_key[r.manifest_key] for r in plan.subsumed)
        self._deletions.manifests.update(plan.delete_manifests)
        self._deletions.manifests.update(p.uncertain_keys)  # earlier failed puts of this checkpoint
        self._deletions.objects = set(plan.delete_objects) | set(plan.deferred_objects)
        self.pending = None
        cid = manifest.checkpoint_id
        self.last_completed = cid
        self._attempts = {c: a for c, a in self._attempts.items() if c >= cid}
        return subsumed
