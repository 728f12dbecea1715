"""DSTL — restore: read back the log (and, later, snapshots) through a per-process cache."""

from restore.reader import ChangelogReader

__all__ = ["ChangelogReader"]
