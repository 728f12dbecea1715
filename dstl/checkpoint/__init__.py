"""Driver-side checkpointing: the coordinator, the manifest codec and the retention planner.

- :mod:`dstl.checkpoint.coordinator` — :class:`CheckpointCoordinator` (runtime: store calls, lock,
  clock, listeners), one per job on the driver;
- :mod:`dstl.checkpoint.manifest` — the manifest codec (pure);
- :mod:`dstl.checkpoint.retention` — :func:`plan_retention` (pure).

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
from dstl.checkpoint.retention import CheckpointRefs, RetentionPlan, plan_retention

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
    "Manifest",
    "RetentionPlan",
    "TaskEntry",
    "UnsafeManifestKeyError",
    "decode_manifest",
    "encode_manifest",
    "plan_retention",
]
