"""Driver-side checkpoint coordinator: ids, acknowledgements, manifest-last commit, retention.

Theory of operation
-------------------
Engine-agnostic (Flink's ``CheckpointCoordinator`` + ``SharedStateRegistry``, seed 004): the
engine integration (``dstl.spark``) calls it on the driver; it knows only task ids, opaque state
handles and object keys. Its parts live beside it — the manifest codec in
:mod:`dstl.checkpoint.manifest`, the retention and orphan planners in
:mod:`dstl.checkpoint.retention`, the object names in :mod:`dstl.layout`, the ids, pending and
retained checkpoints in :mod:`dstl.checkpoint.ledger`, the reads of a recovery in
:mod:`dstl.checkpoint.recovery`, the doomed keys and their deletion passes in
:mod:`dstl.checkpoint.deletion`, orphan collection in :mod:`dstl.checkpoint.orphans`; this
module composes them and adds the manifest put, the lock, the metrics and the listeners.

1. **Trigger.** :meth:`CheckpointCoordinator.trigger` opens a *pending* checkpoint for a set of
   tasks. Ids grow strictly when the coordinator picks them; an explicit id may repeat the last
   completed one (Spark re-runs a micro-batch: the re-run commits a new manifest *attempt* that
   replaces the old one) but never go below it. At most one checkpoint is pending (the Flink
   changelog rule): a new trigger aborts the pending one.
2. **Acknowledge.** Every task reports its state handle, the object keys it references and its
   sizes. A second acknowledgement of the same task replaces the first (a task retry).
3. **Commit = manifest put, last.** When every task has acknowledged, the manifest is written
   under ``checkpoints/{id:016x}-{attempt:04x}.manifest``; the tasks' objects were all stored
   before they acknowledged, so the manifest is the last write of a checkpoint and its existence
   is the checkpoint's existence (G3). A failed put leaves the checkpoint pending with all its
   acknowledgements and raises :class:`CheckpointCommitError`;
   :meth:`~CheckpointCoordinator.complete` retries it under the next attempt number (the failed
   put may have landed: write-once names are never reused).
4. **Retention.** :func:`dstl.checkpoint.retention.plan_retention` keeps the newest ``retained`` checkpoint
   ids and returns the subsumed manifests and the objects no retained or pending checkpoint
   references. They are *doomed*: deleted by :meth:`~CheckpointCoordinator.run_deletions`,
   manifests FIRST and objects only after every doomed manifest is gone, so a crash or a failed
   delete leaves orphans, never a manifest naming deleted data. Deletions run on the injected
   executor (or inline when there is none, after the commit); a failure is logged, counted and
   retried on the next completion — doomed keys are never forgotten, with one exception: when
   a batch fails for good, its keys are deleted one by one, and an object whose own delete
   fails permanently (a symbolic link planted in the store, a name the filesystem refuses) is
   logged, counted (``numberOfUndeletableObjects``) and left alone, so that one bad key cannot
   stop every later deletion pass. Right before deleting, the
   doomed objects are filtered again against the live references (retained and pending), and
   an acknowledgement naming an object that is being deleted at that moment is refused, so
   nothing referenced by a retained or in-flight checkpoint is deleted (G5). Time plays no part.
5. **Notify.** ``on_complete`` then ``on_subsumed`` (and ``on_aborted`` on aborts) go to the
   registered listeners, outside the lock; the same values are returned to the caller
   (:class:`Completion`, :class:`AbortedCheckpoint`).
6. **Recover.** :meth:`CheckpointCoordinator.recover` lists ``checkpoints/``, loads the newest
   manifest (strict: a corrupt one is an error naming it, unless ``fallback=True``), rebuilds the
   retained set — and so the references — from the newest valid manifests, and dooms every
   other manifest (older attempts, subsumed leftovers, corrupt or ghost ones) for deletion at the
   next completion. Recovery itself writes and deletes nothing.
7. **Orphans.** Objects no checkpoint ever took over (uploads of aborted batches, crashes between
   a manifest delete and its objects) are deleted by :meth:`~CheckpointCoordinator.collect_orphans`:
   it lists ``dstl/`` and ``snapshots/``, and :func:`dstl.checkpoint.retention.plan_orphans`
   selects what no retained or pending checkpoint references and whose creation time (from its
   fixed-width name) is older than a grace period that covers live writers' uploads not yet
   acknowledged by any checkpoint. Stale manifests are deleted before any object.

Thread safety: all state sits behind one lock, held for the manifest put too (commits are
serialised anyway); store deletes and listener calls run outside it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NoReturn

from dstl.checkpoint.deletion import DeletionQueue
from dstl.checkpoint.ledger import AbortedCheckpoint, CheckpointLedger, Pending, task_ids
from dstl.checkpoint.manifest import (
    MAX_ID_CHARS,
    MAX_MANIFEST_BYTES,
    MAX_RETAINED,
    Manifest,
    TaskEntry,
    check_properties,
)
from dstl.checkpoint.orphans import OrphanCollector
from dstl.checkpoint.recovery import RECOVER_HINT, list_manifests, load_newest
from dstl.checks import (
    check_bool,
    check_callable,
    check_instance,
    check_int,
    check_protocol,
    check_str,
)
from dstl.errors import (
    ConfigTypeError,
    DstlError,
    ObjectExistsError,
    StorageError,
    UsageError,
)
from dstl.metrics import MetricsRegistry
from dstl.stores.base import BlobStore, check_store

__all__ = [
    "DEFAULT_RETAINED",
    "AbortedCheckpoint",
    "CheckpointCommitError",
    "CheckpointCoordinator",
    "CheckpointListener",
    "Completion",
]

logger = logging.getLogger(__name__)

#: Checkpoints kept. A Spark re-run of batch N restores from checkpoint N-1 while N is still
#: retained, so at least 2 are needed for re-runs; 3 leaves room for a fallback past a damaged one.
DEFAULT_RETAINED = 3


def _usage_properties(field: str, reason: str) -> NoReturn:
    raise UsageError(f"set_properties: {field}: {reason}")


class CheckpointCommitError(StorageError):
    """The manifest of a checkpoint could not be written: the checkpoint is NOT complete.

    Attributes:
        checkpoint_id: the checkpoint.
        key: the manifest key whose put failed (the object may exist anyway: a "ghost" write).
    """

    def __init__(self, checkpoint_id: int, key: str, cause: str, hint: str) -> None:
        self.checkpoint_id = checkpoint_id
        super().__init__(f"checkpoint {checkpoint_id} was not committed: manifest put {key} "
                         f"failed ({cause}); {hint}", key=key)


class CheckpointListener:
    """Receives checkpoint notifications; override what you need (the defaults do nothing).

    Listeners run on the thread that caused the event, outside the coordinator's lock. An
    exception in a listener is logged and does not undo the event or stop other listeners.
    """

    def on_complete(self, checkpoint: Manifest) -> None:
        """``checkpoint``'s manifest was written: it is complete (Flink's
        ``notifyCheckpointComplete``)."""

    def on_subsumed(self, checkpoint: Manifest) -> None:
        """``checkpoint`` is no longer retained (a newer one, or a newer attempt of the same id,
        replaced it); its exclusive objects are being deleted."""

    def on_aborted(self, checkpoint: AbortedCheckpoint) -> None:
        """A pending checkpoint was aborted; it never became complete."""


@dataclass(frozen=True, slots=True)
class Completion:
    """What a completed checkpoint changed (returned by :meth:`CheckpointCoordinator.complete`
    and by the acknowledgement that completed it; truthy).

    Attributes:
        manifest: the committed manifest.
        subsumed: checkpoints this completion subsumed, oldest first.
        deleted: keys deleted before returning (manifests, then objects); empty when deletions
            run on an executor.
    """

    manifest: Manifest
    subsumed: tuple[Manifest, ...]
    deleted: tuple[str, ...]

    @property
    def checkpoint_id(self) -> int:
        return self.manifest.checkpoint_id


def _check_arguments(store: object, job_id: object, retained: object, clock: object,
                     wall_clock: object, metrics: object, executor: object,
                     listeners: object) -> list[CheckpointListener]:
    """The constructor's arguments, checked (one place); returns the listeners as a list.

    Raises:
        ConfigError: a value out of range (ConfigTypeError: a wrong type).
    """
    owner = "CheckpointCoordinator"
    check_store(store, "store", owner)
    check_str(job_id, "job_id", owner, max_chars=MAX_ID_CHARS,
              fix="the job (operator) name; it is written into every manifest")
    check_int(retained, "retained", owner, lo=1, hi=MAX_RETAINED,
              fix="completed checkpoints kept; >= 2 if batches may be re-run")
    check_callable(clock, "clock", owner, args=0, fix="monotonic seconds, e.g. time.monotonic")
    check_callable(wall_clock, "wall_clock", owner, args=0, fix="epoch seconds, e.g. time.time")
    if metrics is not None:
        check_instance(metrics, "metrics", owner, MetricsRegistry)
    if executor is not None:
        check_protocol(executor, "executor", owner, ("submit",),
                       "None or a concurrent.futures.Executor")
    if isinstance(listeners, (str, bytes)) or not isinstance(listeners, Iterable):
        raise ConfigTypeError("listeners", listeners, "an iterable of CheckpointListener",
                              owner=owner)
    out = list(listeners)
    for i, listener in enumerate(out):
        _check_listener(listener, f"listeners[{i}]")
    return out


def _check_listener(listener: object, field: str) -> None:
    check_protocol(listener, field, "CheckpointCoordinator",
                   ("on_complete", "on_subsumed", "on_aborted"),
                   "a dstl.checkpoint.CheckpointListener", fix="subclass CheckpointListener")


class CheckpointCoordinator:
    """Driver-side checkpoint coordinator (see the module docstring).

    It composes a :class:`~dstl.checkpoint.ledger.CheckpointLedger` (ids, the pending and the
    retained checkpoints), a :class:`~dstl.checkpoint.deletion.DeletionQueue` (doomed keys and
    their deletion), an :class:`~dstl.checkpoint.orphans.OrphanCollector` and the reads of
    :mod:`dstl.checkpoint.recovery`, all under one lock; it writes the manifests, keeps the
    metrics and delivers the notifications.

    Args:
        store: where manifests are written and objects deleted (the job's ``state_uri`` root).
        job_id: the job (or operator) whose checkpoints these are; written into every manifest
            and checked on recovery.
        retained: how many checkpoint ids to keep (>= 1; >= 2 for Spark batch re-runs).
        clock: monotonic seconds, for durations and acknowledgement latencies.
        wall_clock: epoch seconds, for the times written into manifests and for the age of
            orphans (object names carry their epoch-ms creation time).
        metrics: a registry to report into; by default one with prefix
            ``CheckpointCoordinator.``.
        executor: runs deletions off the caller's path; ``None`` runs them inline right after
            the commit (deterministic). The coordinator never shuts it down.
        listeners: initial listeners (more with :meth:`add_listener`).
        max_manifest_bytes: the largest manifest this coordinator commits and reads (default
            :data:`~dstl.checkpoint.manifest.MAX_MANIFEST_BYTES`, 16 MiB; a recovery must use at
            least the committing coordinator's value).

    Raises:
        ConfigError: ``retained`` < 1, ``max_manifest_bytes`` < 1024.
        UsageError: ``job_id`` is not a non-empty string.
    """

    def __init__(self, store: BlobStore, *, job_id: str, retained: int = DEFAULT_RETAINED,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 metrics: MetricsRegistry | None = None,
                 executor: Executor | None = None,
                 listeners: Iterable[CheckpointListener] = (),
                 max_manifest_bytes: int = MAX_MANIFEST_BYTES) -> None:
        self._listeners: list[CheckpointListener] = _check_arguments(
            store, job_id, retained, clock, wall_clock, metrics, executor, listeners)
        self._max_manifest_bytes = check_int(
            max_manifest_bytes, "max_manifest_bytes", "CheckpointCoordinator", lo=1024,
            fix="the largest manifest committed and read; a recovery must use at least the "
                "writer's value")
        self._store = store
        self._job_id = job_id
        self._retain = retained
        self._wall = wall_clock
        self._executor = executor
        self._lock = threading.Lock()
        self._futures: set[Future[list[str]]] = set()
        self._metrics = metrics if metrics is not None else MetricsRegistry(
            "CheckpointCoordinator.")
        self._deletions = DeletionQueue(store, self._lock,
                                        live_keys_locked=self._live_keys_locked,
                                        retained_keys_locked=self._retained_keys_locked,
                                        metrics=self._metrics)
        self._ledger = CheckpointLedger(job_id=job_id, retain=retained, clock=clock,
                                        wall_ms=self._wall_ms, deletions=self._deletions,
                                        owner=self.__repr__)
        self._register_metrics(self._metrics)
        self._orphans = OrphanCollector(store, self._lock, self._ledger, self._deletions,
                                        wall_ms=self._wall_ms, collected=self._c_orphans)

    def _register_metrics(self, m: MetricsRegistry) -> None:
        self._c_completed = m.counter("numberOfCompletedCheckpoints")
        self._c_aborted = m.counter("numberOfAbortedCheckpoints")
        self._c_subsumed = m.counter("numberOfSubsumedCheckpoints")
        self._c_failed_commits = m.counter("numberOfFailedCommits")
        self._c_orphans = m.counter("numberOfCollectedOrphans")
        self._h_duration = m.histogram("checkpointDurationMs")
        self._h_ack = m.histogram("checkpointAckLatencyMs")
        m.gauge("lastCheckpointDuration", lambda: self._latest_stat("duration_ms"))
        m.gauge("lastCheckpointFullSize", lambda: self._latest_stat("full_size"))
        m.gauge("lastCheckpointIncrementalSize", lambda: self._latest_stat("incremental_size"))
        m.gauge("lastCompletedCheckpointId", lambda: float(
            -1 if self._ledger.last_completed is None else self._ledger.last_completed))
        m.gauge("numberOfRetainedCheckpoints", lambda: float(len(self._ledger.retained)))
        m.gauge("pendingDeletions", lambda: float(self._deletions.pending_count()))

    def __repr__(self) -> str:
        return (f"CheckpointCoordinator(job_id={self._job_id!r}, store={self._store.location!r}, "
                f"retained={self._retain})")

    # ------------------------------------------------------------------ recovery

    @classmethod
    def recover(cls, store: BlobStore, job_id: str, *, retained: int = DEFAULT_RETAINED,
                fallback: bool = False, clock: Callable[[], float] = time.monotonic,
                wall_clock: Callable[[], float] = time.time,
                metrics: MetricsRegistry | None = None, executor: Executor | None = None,
                listeners: Iterable[CheckpointListener] = (),
                max_manifest_bytes: int = MAX_MANIFEST_BYTES) -> CheckpointCoordinator:
        """Open the coordinator of a store that may hold checkpoints (a restarted driver).

        Lists ``checkpoints/``, loads the newest manifest and then older ones until ``retained``
        checkpoint ids are known (the highest valid attempt of each id), and continues from
        there: ids continue above every id found, deletion decisions use the recovered
        references, and every other manifest is doomed for deletion at the next completion.
        Reads only; writes and deletes nothing.

        Args:
            store: the job's store.
            job_id: must equal the ``job_id`` in the manifests.
            retained: as for the constructor.
            fallback: if the newest manifest is corrupt, log it and use the previous valid one
                (an older attempt of the same id, or an older id) instead of failing.
            clock, wall_clock, metrics, executor, listeners: as for the constructor.

        Returns:
            The coordinator; :meth:`latest` is the checkpoint to restore from (``None`` for an
            empty store).

        Raises:
            CorruptObjectError: (without ``fallback``) the newest manifest is damaged; the error
                names its key. With ``fallback``, only when no manifest is valid.
            UsageError: the manifests belong to another job id.
            StorageError: the store could not be listed or read.
        """
        check_bool(fallback, "fallback", "CheckpointCoordinator")
        coord = cls(store, job_id=job_id, retained=retained, clock=clock, wall_clock=wall_clock,
                    metrics=metrics, executor=executor, listeners=listeners,
                    max_manifest_bytes=max_manifest_bytes)
        stored = list_manifests(store)
        loaded, corrupt = load_newest(store, stored, job_id=job_id, retain=retained,
                                      max_bytes=coord._max_manifest_bytes, fallback=fallback)
        with coord._lock:
            coord._ledger.adopt_recovered(stored, loaded)
            doomed = len(coord._deletions.manifests)
        latest = loaded[0] if loaded else None
        logger.info("recovered job %s from %s: latest checkpoint %s (attempt %s), %d retained, "
                    "%d stale manifests doomed, %d corrupt skipped", job_id, store.location,
                    latest.checkpoint_id if latest else None, latest.attempt if latest else None,
                    len(loaded), doomed, len(corrupt))
        return coord

    # ------------------------------------------------------------------ the protocol

    def trigger(self, tasks: Iterable[str], checkpoint_id: int | None = None) -> int:
        """Start a checkpoint that waits for ``tasks``; abort the pending one, if any.

        Args:
            tasks: the task ids that must acknowledge (non-empty, unique).
            checkpoint_id: ``None`` picks the next id (strictly above every id seen). An
                explicit id must be >= the last completed id; equal to it is a re-run, which
                commits a new manifest attempt replacing the old one.

        Returns:
            The checkpoint id.

        Raises:
            UsageError: no tasks, a repeated or malformed task id, or an id below the last
                completed one or out of range.
            ClosedError: the coordinator is closed.
        """
        tasks_ = task_ids(tasks)
        with self._lock:
            self._ledger.check_open()
            cid, aborted, rerun = self._ledger.open(tasks_, checkpoint_id)
            if aborted is not None:
                self._c_aborted.inc()
        logger.info("triggered checkpoint %d%s for %d tasks", cid, " (re-run)" if rerun else "",
                    len(tasks_))
        if aborted is not None:
            self._deliver("on_aborted", aborted)
        return cid

    def acknowledge(self, checkpoint_id: int, task_id: str, state: Mapping[str, Any],
                    referenced_keys: Sequence[str], full_size: int,
                    incremental_size: int) -> Completion | None:
        """Record one task's part of a checkpoint; commit when every task has acknowledged.

        A repeated acknowledgement of the same task replaces the earlier one (a task retry).

        Args:
            checkpoint_id: the pending checkpoint.
            task_id: one of the tasks it waits for.
            state: the task's state handle, a JSON object (stored in the manifest as is).
            referenced_keys: every object the state needs, all below ``dstl/`` or
                ``snapshots/`` and all already stored.
            full_size: bytes of the task's whole state.
            incremental_size: bytes uploaded for this checkpoint.

        Returns:
            The :class:`Completion` if this acknowledgement completed the checkpoint, else
            ``None``.

        Raises:
            UsageError: the checkpoint is not pending (never triggered, completed, aborted), the
                task is not one of its tasks, a field is malformed, or a referenced object is
                being deleted right now (it was referenced only by subsumed checkpoints).
            UnsafePathError: a key could escape the storage root or is outside ``dstl/`` and
                ``snapshots/``.
            CheckpointCommitError: this was the last acknowledgement and the manifest put
                failed; the checkpoint stays pending (retry with :meth:`complete`).
            ClosedError: the coordinator is closed.
        """
        entry = TaskEntry.of(task_id, state, referenced_keys, full_size, incremental_size)
        with self._lock:
            self._ledger.check_open()
            p, latency_ms, all_in = self._ledger.record_ack(checkpoint_id, entry)
            self._h_ack.update(latency_ms)
            if not all_in:
                return None
            manifest, subsumed = self._commit_locked(p)
        return self._after_commit(manifest, subsumed)

    def complete(self, checkpoint_id: int) -> Completion:
        """Commit a pending checkpoint whose tasks have all acknowledged.

        Normally the last acknowledgement commits; call this to retry after a
        :class:`CheckpointCommitError` (the retry uses the next attempt number).

        Returns:
            The :class:`Completion`.

        Raises:
            UsageError: the checkpoint is not pending, or tasks are still missing (named).
            CheckpointCommitError: the manifest put failed again.
            ClosedError: the coordinator is closed.
        """
        with self._lock:
            self._ledger.check_open()
            p = self._ledger.pending_for(checkpoint_id, "complete")
            missing = [t for t in p.tasks if t not in p.acks]
            if missing:
                raise UsageError(f"complete: checkpoint {checkpoint_id} still waits for "
                                 f"{len(missing)} tasks: {missing[:10]}")
            manifest, subsumed = self._commit_locked(p)
        return self._after_commit(manifest, subsumed)

    def set_properties(self, checkpoint_id: int, properties: Mapping[str, Any]) -> None:
        """Values the pending checkpoint's manifest commits with it (``Manifest.properties``:
        e.g. the Spark operator's watermark); replaces earlier ones. Call it before the last
        acknowledgement.

        Raises:
            UsageError: the checkpoint is not pending, or a name or value is not allowed
                (:func:`~dstl.checkpoint.manifest.check_properties`).
            ClosedError: the coordinator is closed.
        """
        checked = dict(check_properties(dict(properties), _usage_properties))
        with self._lock:
            self._ledger.check_open()
            self._ledger.pending_for(checkpoint_id, "set_properties").properties = checked

    def abort(self, checkpoint_id: int, reason: str) -> AbortedCheckpoint:
        """Abort the pending checkpoint ``checkpoint_id``.

        Manifest puts of this checkpoint that failed (and may have landed anyway) are doomed,
        so no stray manifest survives for a checkpoint the caller was told did not complete.

        Returns:
            The aborted checkpoint (also delivered to ``on_aborted``).

        Raises:
            UsageError: the checkpoint is not pending.
            ClosedError: the coordinator is closed.
        """
        with self._lock:
            self._ledger.check_open()
            self._ledger.pending_for(checkpoint_id, "abort")
            aborted = self._ledger.abort(str(reason))
            self._c_aborted.inc()
        self._deliver("on_aborted", aborted)
        return aborted

    # ------------------------------------------------------------------ queries

    def latest(self) -> Manifest | None:
        """The newest retained (completed) checkpoint, or ``None``."""
        with self._lock:
            return self._ledger.latest()

    def manifests(self) -> tuple[Manifest, ...]:
        """The retained checkpoints, oldest first."""
        with self._lock:
            return tuple(self._ledger.retained)

    @property
    def pending_checkpoint_id(self) -> int | None:
        """The id of the pending checkpoint, or ``None``."""
        with self._lock:
            p = self._ledger.pending
            return None if p is None else p.checkpoint_id

    @property
    def job_id(self) -> str:
        return self._job_id

    def doomed(self) -> tuple[frozenset[str], frozenset[str]]:
        """Keys waiting for deletion: ``(manifests, objects)`` (failed or not yet run)."""
        with self._lock:
            return frozenset(self._deletions.manifests), frozenset(self._deletions.objects)

    def stats(self) -> dict[str, float]:
        """The coordinator's metrics as ``{name: value}`` (Flink-like names: completed and
        aborted checkpoints, last duration and sizes, deleted objects, collected orphans, ...).
        The full statistics of a checkpoint are in its manifest (``latest().stats``)."""
        return self._metrics.snapshot()

    def add_listener(self, listener: CheckpointListener) -> None:
        """Deliver future notifications to ``listener`` too.

        Raises:
            ConfigTypeError: ``listener`` lacks a notification method.
        """
        _check_listener(listener, "listener")
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: CheckpointListener) -> None:
        """Stop delivering to ``listener`` (no error if it was not registered)."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    # ------------------------------------------------------------------ deletion

    def run_deletions(self) -> list[str]:
        """Delete what is doomed, once: manifests first, then — only if every doomed manifest
        is gone — the doomed objects that no retained or pending checkpoint references.

        Runs after every completion (inline or on the executor); callable by hand. Failures are
        logged and counted, and the keys stay doomed for the next run.

        Returns:
            The keys deleted by this call.
        """
        with self._deletions.pass_lock:
            return self._deletions.run_pass_locked()

    def collect_orphans(self, min_age_s: float, now_ms: int | None = None, *,
                        dry_run: bool = False) -> list[str]:
        """Delete objects no checkpoint references (orphans), after a grace period.

        First every stale manifest (in ``checkpoints/`` but neither retained nor a put of the
        pending checkpoint) and every doomed manifest is deleted; if that fails nothing else is
        deleted. Then every object under ``dstl/`` and ``snapshots/`` that no retained or
        pending checkpoint references and whose name says it was created at least
        ``min_age_s`` before ``now_ms`` is deleted. Names without a creation time are left
        alone and logged. A failed delete is logged and retried at the next completion.

        Args:
            min_age_s: the grace period. It must exceed the longest time from an object's
                upload to the acknowledgement that first references it (a few checkpoint
                intervals) plus the clock skew between executors and the driver.
            now_ms: the current epoch time in ms (default: the wall clock).
            dry_run: decide the same way but delete nothing and change nothing; the keys that
                would be deleted are returned (``dstl gc --dry-run``).

        Returns:
            The keys deleted (manifests, then objects); with ``dry_run``, those that would be.

        Raises:
            UsageError: ``min_age_s`` is negative or not finite, or the store holds a manifest
                newer than this coordinator's latest checkpoint that it does not know (it was
                not opened with :meth:`recover`, or another coordinator writes to the store);
                nothing is deleted then.
            StorageError: listing failed.
            ClosedError: the coordinator is closed.
        """
        return self._orphans.collect(min_age_s, now_ms, dry_run=dry_run)

    # ------------------------------------------------------------------ lifecycle

    def close(self, timeout_s: float | None = 30.0) -> None:
        """Refuse further calls and wait up to ``timeout_s`` for deletions already handed to
        the executor. Idempotent. Doomed keys that were not deleted stay in the store (a
        recovering coordinator finds stale manifests; orphan collection finds objects)."""
        with self._lock:
            self._ledger.closed = True
            futures = list(self._futures)
        if futures:
            concurrent.futures.wait(futures, timeout=timeout_s)

    def __enter__(self) -> CheckpointCoordinator:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _wall_ms(self) -> int:
        return int(self._wall() * 1000)

    def _latest_stat(self, name: str) -> float:
        latest = self._ledger.latest()
        return 0.0 if latest is None else float(getattr(latest.stats, name))

    def _retained_keys_locked(self) -> set[str]:
        return self._ledger.retained_keys()

    def _live_keys_locked(self) -> set[str]:
        return self._ledger.live_keys()

    def _commit_locked(self, p: Pending) -> tuple[Manifest, tuple[Manifest, ...]]:
        """Write the manifest, then apply the retention plan to the in-memory state."""
        manifest = self._ledger.next_manifest(p)
        self._put_manifest_locked(p, manifest)
        # Committed: from here on nothing may fail before the in-memory state matches the store.
        subsumed = self._ledger.apply_retention(p, manifest)
        self._c_completed.inc()
        self._c_subsumed.inc(len(subsumed))
        self._h_duration.update(manifest.stats.duration_ms)
        logger.info("completed checkpoint %d attempt %d in %.1f ms: %d tasks, full %d B, "
                    "incremental %d B; subsumed %s; %d objects doomed", manifest.checkpoint_id,
                    manifest.attempt, manifest.stats.duration_ms, len(manifest.tasks),
                    manifest.stats.full_size, manifest.stats.incremental_size,
                    [m.checkpoint_id for m in subsumed], len(self._deletions.objects))
        return manifest, subsumed

    def _put_manifest_locked(self, p: Pending, manifest: Manifest) -> None:
        """The commit: put the manifest, or raise :class:`CheckpointCommitError`."""
        cid, key = p.checkpoint_id, manifest.key
        # Until the put is known to have succeeded the object may exist (a "ghost" write): it
        # is doomed if this checkpoint is aborted or committed under a later attempt.
        data = manifest.encode()
        if len(data) > self._max_manifest_bytes:
            self._c_failed_commits.inc()
            raise CheckpointCommitError(
                cid, key, f"the manifest has {len(data)} bytes, more than max_manifest_bytes="
                f"{self._max_manifest_bytes}", "a recovery would refuse it; raise "
                "CheckpointCoordinator(max_manifest_bytes=...) (and pass the same to recover), "
                "or materialize more often so handles stay short")
        p.uncertain_keys.append(key)
        try:
            self._store.put(key, data)
        except ObjectExistsError as exc:
            p.uncertain_keys.remove(key)  # someone else's object: never ours to delete
            self._c_failed_commits.inc()
            raise CheckpointCommitError(
                cid, key, str(exc), "another query writes to this state_uri: run one query per "
                "state_uri (stop the other query, or give this one a state_uri of its own). "
                + RECOVER_HINT[0].upper() + RECOVER_HINT[1:]
            ) from exc
        except (DstlError, OSError) as exc:
            self._c_failed_commits.inc()
            logger.warning("checkpoint %d: manifest put %s failed: %s", cid, key, exc)
            raise CheckpointCommitError(
                cid, key, str(exc), f"the checkpoint stays pending with all acknowledgements; "
                f"retry with complete({cid}), or re-run it with trigger(tasks, "
                f"checkpoint_id={cid})") from exc
        p.uncertain_keys.remove(key)

    def _after_commit(self, manifest: Manifest,
                      subsumed: tuple[Manifest, ...]) -> Completion:
        deleted: list[str] = []
        if self._executor is None:
            deleted = self.run_deletions()
        else:
            try:
                future = self._executor.submit(self.run_deletions)
            except RuntimeError as exc:  # an executor that was shut down
                logger.warning("deletions not scheduled (retried at the next completion): %s",
                               exc)
            else:
                with self._lock:
                    self._futures.add(future)
                future.add_done_callback(self._forget_future)
        self._deliver("on_complete", manifest)
        for m in subsumed:
            self._deliver("on_subsumed", m)
        return Completion(manifest, subsumed, tuple(deleted))

    def _forget_future(self, future: Future[list[str]]) -> None:
        with self._lock:
            self._futures.discard(future)

    def _deliver(self, event: str, value: Manifest | AbortedCheckpoint) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                getattr(listener, event)(value)
            except Exception:
                logger.exception("checkpoint listener %r failed in %s for checkpoint %d", listener,
                                 event, value.checkpoint_id)
