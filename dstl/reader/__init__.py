"""The state reader: DSTL state as rows — a checkpoint's state, and the changes between
checkpoints — without Spark, used by the Spark sources (:mod:`dstl.spark.datasource`) and the CLI.

Theory of operation
-------------------
Everything starts from the manifests (:mod:`dstl.reader.catalog`): a checkpoint exists iff its
manifest does, and its tasks' states are backend handles naming snapshot objects and change sets.
Planning (:mod:`dstl.reader.plan`, pure) turns handles into *splits* — for a state read, one per
backend handle or key-group slice of one; for a change feed, one per checkpoint and task with
new change sets (FLIP-27's enumerator: the planner discovers what is new, splits are read
independently, the position is a checkpoint id). Reading a state split restores it read-only
through :func:`restore.restore_backend` (:mod:`dstl.reader.state`); reading a change split
fetches exactly its change sets and decodes them (:mod:`dstl.reader.changes`). Every path opens
the store through :class:`~dstl.reader.store.ReadOnlyBlobStore`, so the reader never writes.

``dstl verify`` is :mod:`dstl.reader.verify`; ``dstl inspect`` recognises objects with
:mod:`dstl.reader.objects`.

This package is an entry point like :mod:`dstl.spark` and :mod:`dstl.cli`: it may import
``restore``, ``materializer`` and ``dstl.checkpoint``; nothing below it imports it.
"""

from dstl.reader.catalog import CheckpointCatalog, StoredCheckpoint, TaskState, task_states
from dstl.reader.changes import ChangePlan, plan_change_range, read_change_split
from dstl.reader.errors import (
    ChangesLostError,
    CheckpointDeletedError,
    CheckpointNotFoundError,
    NoStoreError,
    ValueTypeError,
)
from dstl.reader.objects import identify_object
from dstl.reader.plan import (
    ChangeSplit,
    CheckpointView,
    GapFill,
    LogRun,
    StateSplit,
    plan_changes,
    plan_state_splits,
)
from dstl.reader.read import key_bytes_of, read_changes, read_state
from dstl.reader.rows import ChangeRow, StateRow, from_json, to_json, to_plain
from dstl.reader.state import read_state_split
from dstl.reader.store import ReadOnlyBlobStore, open_read_only, require_store
from dstl.reader.verify import VerifyProblem, VerifyReport, verify_checkpoint

__all__ = [
    "ChangePlan",
    "ChangeRow",
    "ChangeSplit",
    "ChangesLostError",
    "CheckpointCatalog",
    "CheckpointDeletedError",
    "CheckpointNotFoundError",
    "CheckpointView",
    "GapFill",
    "LogRun",
    "NoStoreError",
    "ReadOnlyBlobStore",
    "StateRow",
    "StateSplit",
    "StoredCheckpoint",
    "TaskState",
    "ValueTypeError",
    "VerifyProblem",
    "VerifyReport",
    "from_json",
    "identify_object",
    "key_bytes_of",
    "open_read_only",
    "plan_change_range",
    "plan_changes",
    "plan_state_splits",
    "read_change_split",
    "read_changes",
    "read_state",
    "require_store",
    "read_state_split",
    "task_states",
    "to_json",
    "to_plain",
    "verify_checkpoint",
]
