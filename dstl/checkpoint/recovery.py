"""Reading a store's checkpoints back: the manifests listed, the newest valid ones loaded.

Theory of operation
-------------------
Steps 1 and 2 of :meth:`CheckpointCoordinator.recover
<dstl.checkpoint.coordinator.CheckpointCoordinator.recover>` (its module docstring, step 6);
step 3, adopting what was loaded, is :meth:`CheckpointLedger.adopt_recovered
<dstl.checkpoint.ledger.CheckpointLedger.adopt_recovered>`. Reads only.

1. **List.** :func:`list_manifests`: the manifests under ``checkpoints/``, newest
   (checkpoint id, attempt) first; other names there are logged and ignored.
2. **Load.** :func:`load_newest`: from the newest manifest down, the highest valid attempt of
   each id until ``retain`` ids are known. A corrupt newest manifest is an error naming it,
   unless ``fallback``; a manifest of another job is always an error; a manifest larger than
   ``max_bytes`` is refused before it is read.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

from dstl.checkpoint.manifest import Manifest, decode_manifest
from dstl.errors import CorruptObjectError, UsageError
from dstl.layout import MANIFEST_PREFIX, parse_manifest_key
from dstl.stores.base import BlobStore

__all__ = ["RECOVER_HINT", "StoredManifest", "list_manifests", "load_manifest", "load_newest"]

logger = logging.getLogger(__name__)

#: Keys shown in a log line or message before "...".
_LOG_KEYS = 5

#: The fix for a caller of the coordinator API itself (not through the Spark operator, which
#: always recovers): a second run must read the store's checkpoints first.
RECOVER_HINT = ("a CheckpointCoordinator built directly on a store with checkpoints is opened "
                "with CheckpointCoordinator.recover()")


class StoredManifest(NamedTuple):
    """A manifest found in the store; tuples sort by (checkpoint id, attempt)."""

    checkpoint_id: int
    attempt: int
    key: str
    size: int


def list_manifests(store: BlobStore) -> list[StoredManifest]:
    """Recovery step 1: the manifests under ``checkpoints/``, newest first; other names there
    are logged and ignored."""
    stored: list[StoredManifest] = []
    ignored: list[str] = []
    for info in store.list(MANIFEST_PREFIX):
        parsed = parse_manifest_key(info.key)
        if parsed is None:
            ignored.append(info.key)
        else:
            stored.append(StoredManifest(parsed[0], parsed[1], info.key, info.size))
    if ignored:
        logger.warning("recover %s: ignoring %d objects under %s that are not manifests: %s",
                       store.location, len(ignored), MANIFEST_PREFIX, ignored[:_LOG_KEYS])
    stored.sort(reverse=True)
    return stored


def load_newest(store: BlobStore, stored: Sequence[StoredManifest], *, job_id: str, retain: int,
                max_bytes: int, fallback: bool) -> tuple[list[Manifest], list[str]]:
    """Recovery step 2: from the newest manifest down, load the highest valid attempt of
    each id until ``retain`` ids are known. Returns them newest first, and the keys of the
    corrupt manifests skipped.

    Raises:
        CorruptObjectError: (without ``fallback``) the newest manifest is damaged; with
            ``fallback``, only when no manifest is valid.
        UsageError: a manifest belongs to another job id.
    """
    loaded: list[Manifest] = []
    corrupt: list[str] = []
    for cid, _attempt, key, size in stored:
        if len(loaded) == retain:
            break
        if any(m.checkpoint_id == cid for m in loaded):
            continue  # a lower attempt of an id we already have: stale
        try:
            loaded.append(load_manifest(store, key, size, job_id=job_id, max_bytes=max_bytes))
        except CorruptObjectError as exc:
            if not loaded and not fallback:
                exc.add_note(f"recover {store.location}: {key} is the newest manifest; "
                             "pass fallback=True to recover from the previous valid "
                             "checkpoint")
                raise
            logger.warning("recover %s: skipping corrupt manifest %s: %s",
                           store.location, key, exc)
            corrupt.append(key)
    if stored and not loaded:
        raise CorruptObjectError(stored[0].key, 0, f"none of the {len(stored)} manifests "
                                 f"under {MANIFEST_PREFIX} is valid (corrupt: "
                                 f"{corrupt[:_LOG_KEYS]})",
                                 hint="the checkpoint directory is damaged; nothing can be "
                                      "restored from it")
    return loaded, corrupt


def load_manifest(store: BlobStore, key: str, size: int, *, job_id: str,
                  max_bytes: int) -> Manifest:
    """Read and decode one manifest of ``job_id`` (size checked before reading)."""
    if size > max_bytes:
        raise CorruptObjectError(key, 0, f"{size} bytes is larger than the manifest "
                                         f"limit of {max_bytes} bytes "
                                         "(CheckpointCoordinator max_manifest_bytes)")
    m = decode_manifest(store.get(key), key, max_bytes=max_bytes)
    if m.job_id != job_id:
        raise UsageError(f"recover {store.location}: manifest {key} belongs to job "
                         f"{m.job_id!r}, not {job_id!r}; open this job's own "
                         "state_uri, or pass the job id the store was written with")
    return m
