"""The doomed keys of a checkpoint coordinator and the passes that delete them.

Theory of operation
-------------------
:class:`~dstl.checkpoint.coordinator.CheckpointCoordinator` decides what is *doomed* (subsumed
and stale manifests, objects no retained or pending checkpoint references); a
:class:`DeletionQueue` holds those keys and deletes them. The rules (the coordinator's module
docstring, step 4):

1. **Manifests first.** A pass deletes every doomed manifest; objects are deleted only when
   every doomed manifest is gone, so a crash or a failed delete leaves orphans, never a
   manifest naming deleted data.
2. **Filtered again, marked while deleted.** Right before deleting, the doomed objects are
   filtered against the live references (retained and pending) and marked as *being deleted*
   (:attr:`DeletionQueue.deleting`); the coordinator refuses an acknowledgement naming a marked
   key, so nothing a retained or in-flight checkpoint references is deleted (G5).
3. **Never forgotten, except for good.** A failed delete is logged and counted and its keys stay
   doomed for the next pass; only a key whose own delete fails permanently (a symbolic link
   planted in the store, a name the filesystem refuses) is logged, counted
   (``numberOfUndeletableObjects``) and given up, so that one bad key cannot stop every later
   pass.

The queue shares the coordinator's lock (its sets are the coordinator's state, read and changed
under that lock together with the retained checkpoints); store deletes run outside it, one pass
at a time (:attr:`DeletionQueue.pass_lock`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from dstl.errors import DstlError
from dstl.metrics import MetricsRegistry
from dstl.stores.base import BlobStore, is_retryable

__all__ = ["DeletionQueue"]

logger = logging.getLogger(__name__)

#: Keys shown in a log line before "...".
_LOG_KEYS = 5


class DeletionQueue:
    """The doomed manifests and objects of one coordinator, and their deletion.

    Args:
        store: where the keys are deleted.
        lock: the coordinator's lock; :attr:`manifests`, :attr:`objects` and :attr:`deleting`
            are read and changed only under it.
        live_keys_locked: the keys a retained or pending checkpoint references (called under
            ``lock``).
        retained_keys_locked: the keys a retained checkpoint references (called under ``lock``).
        metrics: the registry its counters go into (``numberOfDeletedObjects``,
            ``numberOfDeletedManifests``, ``numberOfDeleteFailures``,
            ``numberOfUndeletableObjects``).
    """

    def __init__(self, store: BlobStore, lock: threading.Lock, *,
                 live_keys_locked: Callable[[], set[str]],
                 retained_keys_locked: Callable[[], set[str]],
                 metrics: MetricsRegistry) -> None:
        self._store = store
        self._lock = lock
        self._live_keys_locked = live_keys_locked
        self._retained_keys_locked = retained_keys_locked
        #: one deletion pass at a time
        self.pass_lock = threading.Lock()
        #: doomed manifests (deleted first)
        self.manifests: set[str] = set()
        #: doomed objects (deleted once no doomed manifest is left)
        self.objects: set[str] = set()
        #: keys being deleted at this moment (an acknowledgement naming one is refused)
        self.deleting: set[str] = set()
        self._c_deleted_objects = metrics.counter("numberOfDeletedObjects")
        self._c_deleted_manifests = metrics.counter("numberOfDeletedManifests")
        self._c_delete_failures = metrics.counter("numberOfDeleteFailures")
        self._c_undeletable = metrics.counter("numberOfUndeletableObjects")

    def pending_count(self) -> int:
        """How many keys wait for deletion (read without the lock: a gauge)."""
        return len(self.manifests) + len(self.objects)

    def run_pass_locked(self) -> list[str]:
        """One deletion pass; the caller holds :attr:`pass_lock`. Returns the keys deleted."""
        with self._lock:
            manifests = sorted(self.manifests)
            retained_refs = self._retained_keys_locked()
            # Referenced again by a retained checkpoint: its subsumption will doom it anew.
            self.objects -= retained_refs
            objects = sorted(self.objects - self._live_keys_locked())
            if not manifests and not objects:
                return []
        if manifests and not self._delete_doomed_manifests(manifests, len(objects)):
            return []
        if not objects:
            return manifests
        return manifests + self._delete_doomed_objects(objects, manifests)

    def delete_marked(self, keys: list[str], what: str) -> list[str]:
        """Delete ``keys``, already marked as :attr:`deleting` by the caller; those that fail
        transiently are doomed for the next pass, those that fail for good are given up (see
        :meth:`delete_keys`). Returns the keys deleted."""
        try:
            deleted, given_up = self.delete_keys(keys, what)
        finally:
            with self._lock:
                self.deleting.difference_update(keys)
        with self._lock:
            # What failed transiently is retried at the next completion.
            self.objects.update(set(keys) - set(deleted) - set(given_up))
            self.objects.difference_update(deleted)
            self.objects.difference_update(given_up)
        return deleted

    def _delete_doomed_manifests(self, manifests: list[str], objects_waiting: int) -> bool:
        """Deletion step 1; False (logged, the keys stay doomed) if the delete failed."""
        try:
            self._store.delete(manifests)
        except (DstlError, OSError) as exc:
            self._c_delete_failures.inc()
            logger.warning("deleting %d manifests failed; they and %d objects stay doomed "
                           "for the next completion: %s", len(manifests), objects_waiting, exc)
            return False
        with self._lock:
            self.manifests.difference_update(manifests)
        self._c_deleted_manifests.inc(len(manifests))
        return True

    def _delete_doomed_objects(self, objects: list[str], manifests: list[str]) -> list[str]:
        """Deletion step 2, after every doomed manifest is gone: the objects still unreferenced;
        returns those deleted."""
        with self._lock:
            # Since the caller took its snapshot an acknowledgement may have named one.
            objects = sorted(set(objects) - self._live_keys_locked())
            self.deleting.update(objects)
        try:
            deleted, given_up = self.delete_keys(objects, "unreferenced objects")
        finally:
            with self._lock:
                self.deleting.difference_update(objects)
        with self._lock:
            self.objects.difference_update(deleted)
            self.objects.difference_update(given_up)
        if deleted:
            self._c_deleted_objects.inc(len(deleted))
            logger.info("deleted %d manifests and %d unreferenced objects: %s", len(manifests),
                        len(deleted), (manifests + deleted)[:_LOG_KEYS])
        return deleted

    def delete_keys(self, keys: list[str], what: str) -> tuple[list[str], list[str]]:
        """Delete ``keys``; returns ``(deleted, given up)``.

        A failed batch is logged and counted. If its failure is transient, nothing is given up
        (the keys stay doomed for the next completion). If it is permanent, each key is tried on
        its own, so one key the store refuses for good (a symbolic link planted in the store, a
        name the filesystem rejects, a permission denied on that object alone) cannot stop the
        deletion of every other key, in this pass and all later ones: a key whose own delete
        fails permanently is logged with its error, counted (``numberOfUndeletableObjects``) and
        given up. It stays in the store; orphan collection sees it again only if the store lists
        it, and a link is never listed.
        """
        if not keys:
            return [], []
        try:
            self._store.delete(keys)
        except (DstlError, OSError) as exc:
            self._c_delete_failures.inc()
            if is_retryable(exc) or len(keys) == 1:
                if is_retryable(exc):
                    logger.warning("deleting %d %s failed; they stay doomed for the next "
                                   "completion: %s", len(keys), what, exc)
                    return [], []
                self._give_up(keys[0], exc)
                return [], keys
            logger.warning("deleting %d %s failed for good (%s); deleting them one by one",
                           len(keys), what, exc)
            return self._delete_one_by_one(keys)
        return keys, []

    def _delete_one_by_one(self, keys: list[str]) -> tuple[list[str], list[str]]:
        deleted: list[str] = []
        given_up: list[str] = []
        for key in keys:
            try:
                self._store.delete([key])
            except (DstlError, OSError) as exc:
                if is_retryable(exc):
                    continue  # stays doomed: retried at the next completion
                self._give_up(key, exc)
                given_up.append(key)
            else:
                deleted.append(key)
        return deleted, given_up

    def _give_up(self, key: str, exc: BaseException) -> None:
        self._c_undeletable.inc()
        logger.warning("object %s cannot be deleted (%s: %s); it is left in %s and no longer "
                       "retried — remove it by hand once the cause is fixed", key,
                       type(exc).__name__, exc, self._store.location)
