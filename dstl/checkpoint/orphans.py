"""Orphan collection: stale manifests, then objects no checkpoint references, after a grace.

Theory of operation
-------------------
:meth:`CheckpointCoordinator.collect_orphans
<dstl.checkpoint.coordinator.CheckpointCoordinator.collect_orphans>` (its module docstring,
step 7) is an :class:`OrphanCollector`. The rules:

1. **Manifests first.** Every *stale* manifest (in ``checkpoints/`` but neither retained nor a
   put of the pending checkpoint) and every doomed one is deleted in one deletion pass; if any
   is left, no object is deleted.
2. **Another writer stops it.** A manifest newer than the latest retained checkpoint that the
   coordinator does not know means another query writes to the store: nothing is deleted.
3. **Orphans.** :func:`~dstl.checkpoint.retention.plan_orphans` selects, from the listing of
   ``dstl/`` and ``snapshots/``, what no retained or pending checkpoint references and what was
   created (per its fixed-width name) before the grace period. They are planned and marked as
   being deleted under one hold of the coordinator's lock, so an acknowledgement naming one
   either comes first (and keeps it) or is refused.
4. **Dry run.** The same decisions with nothing deleted or changed.

What it needs of the coordinator's state is :class:`CheckpointView`, read under the
coordinator's lock.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Protocol

from dstl.checkpoint.deletion import DeletionQueue
from dstl.checkpoint.recovery import RECOVER_HINT
from dstl.checkpoint.retention import ListedObject, OrphanPlan, plan_orphans
from dstl.checks import check_bool
from dstl.errors import UsageError
from dstl.layout import MANIFEST_PREFIX, REFERENCE_PREFIXES, parse_manifest_key
from dstl.metrics import Counter
from dstl.stores.base import BlobStore

__all__ = ["CheckpointView", "OrphanCollector", "grace_ms"]

logger = logging.getLogger(__name__)

#: Keys shown in a log line before "...".
_LOG_KEYS = 5


class CheckpointView(Protocol):
    """What orphan collection reads of the coordinator's state (under its lock)."""

    def check_open(self) -> None:
        """Raise ``ClosedError`` if the coordinator is closed."""

    def live_keys(self) -> set[str]:
        """The objects a retained or pending checkpoint references."""

    def kept_manifest_keys(self) -> set[str]:
        """The manifests that are not stale."""

    def newest_retained_id(self) -> int:
        """The newest retained checkpoint id, or -1."""


def grace_ms(min_age_s: float) -> int:
    """``collect_orphans``' grace period in ms, validated."""
    if isinstance(min_age_s, bool) or not isinstance(min_age_s, (int, float)) \
            or not math.isfinite(min_age_s) or min_age_s < 0:
        raise UsageError(f"collect_orphans: min_age_s={min_age_s!r} must be a finite number "
                         ">= 0 (seconds)")
    return int(min_age_s * 1000)


class OrphanCollector:
    """Deletes stale manifests and orphaned objects of one coordinator's store (see the module
    docstring).

    Args:
        store: the job's store.
        lock: the coordinator's lock (``view`` and ``deletions`` are read under it).
        view: the coordinator's state.
        deletions: the coordinator's deletion queue.
        wall_ms: epoch milliseconds (the default ``now``).
        collected: the counter of orphans deleted (``numberOfCollectedOrphans``).
    """

    def __init__(self, store: BlobStore, lock: threading.Lock, view: CheckpointView,
                 deletions: DeletionQueue, *, wall_ms: Callable[[], int],
                 collected: Counter) -> None:
        self._store = store
        self._lock = lock
        self._view = view
        self._deletions = deletions
        self._wall_ms = wall_ms
        self._c_orphans = collected

    def collect(self, min_age_s: float, now_ms: int | None = None, *,
                dry_run: bool = False) -> list[str]:
        """:meth:`CheckpointCoordinator.collect_orphans
        <dstl.checkpoint.coordinator.CheckpointCoordinator.collect_orphans>`."""
        grace = grace_ms(min_age_s)
        check_bool(dry_run, "dry_run", "CheckpointCoordinator.collect_orphans")
        now = self._wall_ms() if now_ms is None else int(now_ms)
        if dry_run:
            return self._plan(grace, now)
        with self._deletions.pass_lock:
            with self._lock:
                self._view.check_open()
            self._doom_stale_manifests()
            deleted = self._deletions.run_pass_locked()
            with self._lock:
                if self._deletions.manifests:
                    logger.warning("collect_orphans: %d manifests could not be deleted; no "
                                   "objects deleted", len(self._deletions.manifests))
                    return deleted
            listed = self._list_objects()
            with self._lock:
                # Planned and marked under one lock hold: an acknowledgement naming one of
                # these objects either comes first (and keeps it) or is refused.
                plan = plan_orphans(listed, self._view.live_keys(), now_ms=now,
                                    grace_ms=grace)
                self._deletions.deleting.update(plan.delete)
            return deleted + self._delete_orphans(plan)

    def _plan(self, grace: int, now_ms: int) -> list[str]:
        """What :meth:`collect` would delete now — the stale and doomed manifests, then the
        orphans — with nothing deleted or changed."""
        with self._deletions.pass_lock:
            with self._lock:
                self._view.check_open()
            stale = self._stale_manifests()
            listed = self._list_objects()
            with self._lock:
                manifests = sorted(self._deletions.manifests | stale)
                plan = plan_orphans(listed, self._view.live_keys(), now_ms=now_ms,
                                    grace_ms=grace)
        return manifests + list(plan.delete)

    def _list_objects(self) -> list[ListedObject]:
        return [ListedObject.of(info.key, info.size)
                for prefix in REFERENCE_PREFIXES for info in self._store.list(prefix)]

    def _doom_stale_manifests(self) -> None:
        """Doom every stale manifest (see :meth:`_stale_manifests`)."""
        stale = self._stale_manifests()
        with self._lock:
            self._deletions.manifests |= stale

    def _stale_manifests(self) -> set[str]:
        """Every manifest in the store that is neither retained nor a put of the pending
        checkpoint; refuse (before anything is deleted) when one is newer than the latest
        retained checkpoint and unknown to this coordinator."""
        listed = [info.key for info in self._store.list(MANIFEST_PREFIX)]
        with self._lock:
            keep = self._view.kept_manifest_keys()
            newest = self._view.newest_retained_id()
            stale = set()
            for k in listed:
                parsed = parse_manifest_key(k)
                if parsed is None or k in keep:
                    continue
                if parsed[0] > newest and k not in self._deletions.manifests:
                    raise UsageError(
                        f"another query writes to this state_uri: {self._store.location} "
                        f"holds checkpoint {parsed[0]} ({k}), which this query did not write "
                        f"(its latest is {newest}); nothing was deleted. Run one query per "
                        "state_uri: stop the other query, or give this one a state_uri of its "
                        f"own ({RECOVER_HINT})")
                stale.add(k)
        return stale

    def _delete_orphans(self, plan: OrphanPlan) -> list[str]:
        """Delete the orphans ``plan`` selected (already marked as being deleted); those that
        fail transiently are doomed for the next completion, those that fail for good are
        given up (see :meth:`DeletionQueue.delete_keys`)."""
        if plan.unnamed:
            logger.warning("collect_orphans: left alone %d objects whose names carry no "
                           "creation time: %s", len(plan.unnamed), plan.unnamed[:_LOG_KEYS])
        orphans = list(plan.delete)
        deleted = self._deletions.delete_marked(orphans, "orphans")
        self._c_orphans.inc(len(deleted))
        if deleted:
            logger.info("collect_orphans: deleted %d of %d orphans created before %d ms; kept "
                        "%d referenced, %d younger", len(deleted), len(orphans),
                        plan.cutoff_ms, len(plan.referenced), len(plan.too_young))
        return deleted
