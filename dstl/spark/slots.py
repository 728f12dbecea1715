"""Getting a partition's state at the base checkpoint, before a task processes its rows.

Theory of operation
-------------------
A task must start from exactly the state after the last committed checkpoint (``base``), in
one of these ways (:func:`acquire`; the winner is reported as the task's
:class:`~dstl.spark.report.SlotAccess`):

1. **hit** — this process served the partition in the base checkpoint and (LMDB) no other worker
   advanced the shared on-disk table since: the table batch-id file names the base batch and
   the table marker the base handle (so not another attempt of the same batch). The backend is
   current; it is told the base completed (hands the log over, unblocks materialization) and
   which checkpoints are no longer retained (their log may be truncated).
2. **adopt** — LMDB only: another worker of this executor served it, and the batch-id file and
   the table marker say the on-disk table is at the base: open the table and install the base
   handle as the log base, taking the state ids from the marker, without reading anything from
   the store.
3. **restore** — anything else (the partition moved, the worker was replaced, a batch is re-run,
   the table's batch is unknown): clear the local table and restore from the base handles
   (snapshot + log replay through the cache); **rescale** when the partitioning changed and
   several or partial handles meet the partition's key groups.
4. **new** — no handle meets the partition's key groups (first batch): an empty backend.
"""

from __future__ import annotations

import dataclasses
import time

from dstl.keygroups import KeyGroupRange
from dstl.spark.config import TaskInput
from dstl.spark.processor import StatefulProcessorHandle, input_rows_takes_timer_values
from dstl.spark.report import SlotAccess
from dstl.spark.runtime import Slot, WorkerRuntime
from materializer.backend import ChangelogKeyedStateBackend
from materializer.handles import ChangelogStateBackendHandle
from materializer.table_marker import TableMarker
from restore.restore import RestoreStats, restore_backend

__all__ = ["acquire"]


def acquire(rt: WorkerRuntime, partition: int, task_input: TaskInput
            ) -> tuple[Slot, SlotAccess]:
    """The partition's slot, its backend at exactly the base checkpoint's state, and how it got
    there (see the module docstring)."""
    slot = rt.slots.get(partition)
    if slot is not None and _is_at_base(rt, slot, partition, task_input):
        _complete_base(slot.backend, task_input)
        return slot, SlotAccess("hit")
    rt.drop(partition)
    started = time.monotonic()
    backend, access = _open_at_base(rt, partition, task_input)
    access = dataclasses.replace(access, restore_seconds=time.monotonic() - started)
    processor = rt.cfg.processor()
    handle = StatefulProcessorHandle(backend, rt.cfg.time_mode)
    processor.init(handle)
    base = _base_handle(task_input, partition)
    slot = Slot(backend, processor, task_input.base_checkpoint, handle,
                input_rows_takes_timer_values(processor),
                None if access.access == "rescale" else base)
    rt.slots[partition] = slot
    return slot, access


def _is_at_base(rt: WorkerRuntime, slot: Slot, partition: int, task_input: TaskInput) -> bool:
    """Whether this worker's backend of the partition is current."""
    if (slot.checkpoint_id != task_input.base_checkpoint
            or slot.backend.key_groups != rt.cfg.key_groups(partition)):
        return False
    # The same batch id is not the same attempt: another worker may have re-run the batch, and
    # the driver committed that attempt. Its handle differs (its change sets and snapshot pieces
    # have names unique per upload), and so does the state its snapshot chain continues from.
    base = _base_handle(task_input, partition)
    if slot.at != base:
        return False
    # An LMDB table is shared on disk by every worker of the executor: this worker's backend is
    # current only if no other worker has written the table since (the batch-id file says which
    # batch the table holds, the table marker which attempt of it).
    return rt.cfg.table != "lmdb" or (
        base is not None and rt.read_table_batch_id(partition) == task_input.base_checkpoint
        and _holds(slot.backend, base))


def _base_handle(task_input: TaskInput, partition: int) -> ChangelogStateBackendHandle | None:
    """The base checkpoint's handle of ``partition`` (``None``: it has none)."""
    raw = task_input.base_handles.get(partition)
    return None if raw is None else ChangelogStateBackendHandle.from_json(
        raw, key=f"checkpoint {task_input.base_checkpoint}: handle of partition {partition}")


def _complete_base(backend: ChangelogKeyedStateBackend, task_input: TaskInput) -> None:
    """Tell a current backend the base checkpoint completed, and which older ones are gone."""
    if task_input.base_checkpoint < 0:
        return
    backend.notify_checkpoint_complete(task_input.base_checkpoint)
    if task_input.retained:
        # checkpoints the coordinator no longer retains: their log may be truncated
        old = [c for c in backend.checkpoint_ids() if c < min(task_input.retained)]
        if old:
            backend.notify_checkpoint_subsumed(max(old))


def _open_at_base(rt: WorkerRuntime, partition: int, task_input: TaskInput
                  ) -> tuple[ChangelogKeyedStateBackend, SlotAccess]:
    """A new backend of the partition at the base: new, adopted or restored."""
    cfg = rt.cfg
    key_groups = cfg.key_groups(partition)
    operator_id = cfg.operator_id(partition)
    # every base handle whose key groups meet ours (several or partial ones after a change of
    # `partitions`: rescaling)
    handles = [h for h in (ChangelogStateBackendHandle.from_json(
                               j, key=f"checkpoint {task_input.base_checkpoint}: handle of "
                                      f"partition {p}")
                           for p, j in task_input.base_handles.items())
               if len(h.key_groups.intersection(key_groups))]
    if not handles:  # no state yet (first batch, or a partition that never had a checkpoint)
        return ChangelogKeyedStateBackend(
            rt.storage, operator_id, key_groups, cfg.max_parallelism, table=cfg.table,
            options=cfg.table_backend_options, local_directory=rt.operator_dir,
            clear_local=True, auto_materialize=False), SlotAccess("new")
    same_layout = len(handles) == 1 and handles[0].key_groups == key_groups
    if (same_layout and cfg.table == "lmdb"
            and rt.read_table_batch_id(partition) == task_input.base_checkpoint):
        adopted = _adopt(rt, operator_id, key_groups, handles[0])
        if adopted is not None:
            return adopted, SlotAccess("adopt")
    stats = RestoreStats()
    backend = restore_backend(handles, rt.storage, key_groups, table=cfg.table, cache=rt.cache,
                              operator_id=operator_id, max_parallelism=cfg.max_parallelism,
                              options=cfg.table_backend_options, local_directory=rt.operator_dir,
                              stats=stats, auto_materialize=False)
    return backend, SlotAccess("restore" if same_layout else "rescale",
                               restored_changes=int(stats.get("changes", 0)),
                               restored_entries=int(stats.get("entries", 0)))


def _marker(backend: ChangelogKeyedStateBackend) -> TableMarker | None:
    raw = backend.tables.read_marker()
    return None if raw is None else TableMarker.from_bytes(
        raw, where=f"{backend.tables.path} (table marker)")


def _holds(backend: ChangelogKeyedStateBackend, h: ChangelogStateBackendHandle) -> bool:
    """Whether the partition's on-disk table holds exactly checkpoint ``h``."""
    marker = _marker(backend)
    return marker is not None and marker.holds(h)


def _adopt(rt: WorkerRuntime, operator_id: str, key_groups: KeyGroupRange,
           h: ChangelogStateBackendHandle) -> ChangelogKeyedStateBackend | None:
    """Open the partition's on-disk LMDB table (another worker of this executor wrote it) as
    checkpoint ``h`` without reading anything from the store — if its marker says it holds
    exactly ``h``; the state ids come from the marker. ``None``: restore instead."""
    cfg = rt.cfg
    backend = ChangelogKeyedStateBackend(rt.storage, operator_id, key_groups,
                                         cfg.max_parallelism, table=cfg.table,
                                         options=cfg.table_backend_options,
                                         local_directory=rt.operator_dir, adopt_local=True,
                                         auto_materialize=False)
    try:
        marker = _marker(backend)
        if marker is None or not marker.holds(h):
            backend.close()
            return None
        backend.install_restored(h.materialized, h.non_materialized, h.materialization_id)
        for sid, m in marker.states.items():
            backend.register_restored_state(m, int(sid))
        return backend
    except BaseException:
        backend.close()
        raise
