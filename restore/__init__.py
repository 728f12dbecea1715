"""DSTL — restore: read back the log and snapshots through a per-process cache.

``restore_backend`` (and ``RestoreStats``, ``plan_restore``, ``RestorePlan``) are imported on first
use, so that reading the log (``ChangelogReader``, ``LocalFileCache``) does not load the state
tables. ``LeasingCache``, ``ObjectLease`` and ``PrefetchItem`` are the cache seam
(:mod:`restore.leasing`).
"""

from typing import Any

from restore.cache import CacheLease, LocalFileCache
from restore.leasing import LeasingCache, ObjectLease, PrefetchItem
from restore.reader import VERIFIERS, ChangelogReader, SegmentCache, verify_segment, verify_snapshot

__all__ = ["VERIFIERS", "CacheLease", "ChangelogReader", "LeasingCache", "LocalFileCache",
           "ObjectLease", "PrefetchItem", "RestorePlan", "RestoreStats", "SegmentCache",
           "plan_restore", "restore_backend", "verify_segment", "verify_snapshot"]


def __getattr__(name: str) -> Any:
    if name in ("restore_backend", "RestoreStats", "plan_restore", "RestorePlan"):
        from restore import restore as _restore
        return getattr(_restore, name)
    raise AttributeError(f"module 'restore' has no attribute {name!r}")
