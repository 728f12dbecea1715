"""Driver-side checkpointing: the coordinator, the manifest codec and the retention planner.

- :mod:`dstl.checkpoint.coordinator` — :class:`CheckpointCoordinator` (runtime: the manifest put,
  lock, metrics, listeners), one per job on the driver, composed of
  :mod:`~dstl.checkpoint.ledger` (ids, pending and retained checkpoints),
  :mod:`~dstl.checkpoint.recovery` (a store's manifests read back),
  :mod:`~dstl.checkpoint.deletion` (doomed keys and their deletion) and
  :mod:`~dstl.checkpoint.orphans` (orphan collection);
- :mod:`dstl.checkpoint.manifest` — the manifest codec (pure);
- :mod:`dstl.checkpoint.retention` — :func:`plan_retention` and :func:`plan_orphans` (pure).

Object names (manifest keys, the referenceable prefixes, creation times) come from
:mod:`dstl.layout`. This layer sits above the log core and below the entry points: it imports the
core only, never ``dstl.spark``, ``dstl.cli``, ``materializer`` or ``restore`` — the tasks' state
handles are opaque JSON to it (an import contract in ``pyproject.toml`` checks this).
"""

from dstl.checkpoint.coordinator import (
    DEFAULT_RETAINED,
    AbortedCheckpoint,
    CheckpointCommitError,
    CheckpointCoordinator,
    CheckpointListener,
    Completion,
)
from dstl.checkpoint.manifest import (
    CheckpointStats,
    CorruptManifestError,
    Manifest,
    TaskEntry,
    UnsafeManifestKeyError,
    decode_manifest,
    encode_manifest,
)
from dstl.checkpoint.retention import (
    CheckpointRefs,
    ListedObject,
    OrphanPlan,
    RetentionPlan,
    plan_orphans,
    plan_retention,
)

__all__ = [
    "DEFAULT_RETAINED",
    "AbortedCheckpoint",
    "CheckpointCommitError",
    "CheckpointCoordinator",
    "CheckpointListener",
    "CheckpointRefs",
    "CheckpointStats",
    "Completion",
    "CorruptManifestError",
    "ListedObject",
    "Manifest",
    "OrphanPlan",
    "RetentionPlan",
    "TaskEntry",
    "UnsafeManifestKeyError",
    "decode_manifest",
    "encode_manifest",
    "plan_orphans",
    "plan_retention",
]
