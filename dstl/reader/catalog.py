"""The checkpoints of a store, as a reader sees them: listed from ``checkpoints/``, each decoded
strictly, its tasks' states parsed as backend handles.

Theory of operation
-------------------
A checkpoint exists iff its manifest exists (the coordinator writes it last), so listing
``checkpoints/`` is the whole catalog; no coordinator is needed and nothing is written. For each
checkpoint id the highest attempt is the checkpoint — the rule
:meth:`~dstl.checkpoint.CheckpointCoordinator.recover` follows (a lower attempt is a replaced
re-run or a doomed leftover). A manifest is untrusted input: it is decoded with
:func:`~dstl.checkpoint.decode_manifest` (every byte checked) and each task's ``state`` with
:meth:`~materializer.handles.ChangelogStateBackendHandle.from_json_obj`; a state that is not a
DSTL backend handle is a :class:`~dstl.errors.CorruptObjectError` naming the manifest and task.

A store may hold a few more manifests than the job retains (subsumed ones whose deletion has not
run yet); they are listed and readable while they exist. Retention deletes manifests before
the objects they name, so a checkpoint whose manifest is listed had all its objects at that
moment; a reader that later finds an object missing re-checks the manifest to tell "deleted
under me" (:class:`~dstl.reader.errors.CheckpointDeletedError`) from a damaged store.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dstl.checkpoint.manifest import Manifest, decode_manifest
from dstl.checks import check_protocol, check_str
from dstl.errors import CorruptObjectError, ObjectNotFoundError, UsageError
from dstl.layout import MANIFEST_PREFIX, parse_manifest_key
from dstl.reader.checks import check_checkpoint_id
from dstl.reader.errors import CheckpointDeletedError, CheckpointNotFoundError
from dstl.stores.base import BlobStore
from materializer.handles import ChangelogStateBackendHandle

__all__ = ["CheckpointCatalog", "StoredCheckpoint", "TaskState", "task_states"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, order=True)
class StoredCheckpoint:
    """A manifest found by listing (not decoded yet); sorts by id."""

    checkpoint_id: int
    attempt: int
    key: str
    size: int


@dataclass(frozen=True, slots=True)
class TaskState:
    """One task's part of a checkpoint: its id (under Spark ``p<N>``) and its backend handle."""

    task_id: str
    handle: ChangelogStateBackendHandle


def task_states(manifest: Manifest) -> list[TaskState]:
    """The tasks of ``manifest`` with their states parsed as backend handles, in manifest order.

    Raises:
        CorruptObjectError: a task's state is not a DSTL backend handle (names the manifest and
            the task).
    """
    out = []
    for t in manifest.tasks:
        try:
            out.append(TaskState(t.task_id, ChangelogStateBackendHandle.from_json_obj(
                dict(t.state))))
        except UsageError as exc:
            raise CorruptObjectError(manifest.key, 0, f"task {t.task_id!r}: its state is not a "
                                                      f"DSTL backend handle ({exc})",
                                     hint="the manifest was written by another program, or is "
                                          "damaged") from exc
    return out


class CheckpointCatalog:
    """The checkpoints of one store (optionally of one job).

    Args:
        store: the store (a :class:`~dstl.reader.store.ReadOnlyBlobStore` in every reader path).
        job_id: when given, a manifest of another job is a :class:`~dstl.errors.UsageError`
            (under Spark the job id is the operator's name).
    """

    def __init__(self, store: BlobStore, job_id: str | None = None) -> None:
        owner = "CheckpointCatalog"
        check_protocol(store, "store", owner, ("get", "get_range", "head", "list"),
                       "a BlobStore (dstl.reader.open_read_only(state_uri))")
        self.store: BlobStore = store
        self.job_id = None if job_id is None else check_str(job_id, "job_id", owner)

    @property
    def location(self) -> str:
        return self.store.location

    def checkpoints(self) -> list[StoredCheckpoint]:
        """The highest attempt of every checkpoint id, oldest first (other names under
        ``checkpoints/`` are ignored)."""
        best: dict[int, StoredCheckpoint] = {}
        for info in self.store.list(MANIFEST_PREFIX):
            parsed = parse_manifest_key(info.key)
            if parsed is None:
                logger.debug("ignoring %s: not a manifest name", info.key)
                continue
            found = StoredCheckpoint(parsed[0], parsed[1], info.key, info.size)
            if parsed[0] not in best or best[parsed[0]].attempt < parsed[1]:
                best[parsed[0]] = found
        return sorted(best.values())

    def ids(self) -> list[int]:
        """Checkpoint ids in the store, ascending."""
        return [c.checkpoint_id for c in self.checkpoints()]

    def find(self, checkpoint_id: int | None = None) -> StoredCheckpoint:
        """The stored manifest of ``checkpoint_id`` (``None``: the newest).

        Raises:
            CheckpointNotFoundError: no such checkpoint (or none at all).
            ConfigError: ``checkpoint_id`` is not ``None`` or an int >= 0.
        """
        check_checkpoint_id(checkpoint_id, "checkpoint_id", "CheckpointCatalog.find")
        listed = self.checkpoints()
        if checkpoint_id is None and listed:
            return listed[-1]
        for c in listed:
            if c.checkpoint_id == checkpoint_id:
                return c
        raise CheckpointNotFoundError(checkpoint_id, self.location,
                                      [c.checkpoint_id for c in listed])

    def manifest(self, checkpoint_id: int | None = None) -> Manifest:
        """Load and verify the manifest of ``checkpoint_id`` (``None``: the newest).

        Raises:
            CheckpointNotFoundError: no such checkpoint.
            CorruptObjectError: the manifest is damaged (names it and the field).
            UsageError: it belongs to another job than ``job_id``.
        """
        return self.load(self.find(checkpoint_id))

    def load(self, stored: StoredCheckpoint) -> Manifest:
        """Load and verify one listed manifest (see :meth:`manifest`)."""
        try:
            data = self.store.get(stored.key)
        except ObjectNotFoundError as exc:
            raise CheckpointDeletedError(stored.checkpoint_id, stored.key,
                                         self.location) from exc
        m = decode_manifest(data, stored.key)
        if self.job_id is not None and m.job_id != self.job_id:
            raise UsageError(f"checkpoint {m.checkpoint_id} in {self.location} belongs to job "
                             f"{m.job_id!r}, not {self.job_id!r}; pass the operator name the "
                             "job runs under (or none)")
        return m

    def exists(self, stored: StoredCheckpoint) -> bool:
        """Whether the manifest is still there (a reader that finds an object missing asks)."""
        return self.store.head(stored.key) is not None
