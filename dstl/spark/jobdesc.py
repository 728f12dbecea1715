"""Spark job descriptions for the operator's jobs: what the Spark UI (and the status store, the
REST API, event logs) shows for each job of a batch.

Theory of operation
-------------------
Spark labels a job with the ``spark.job.description`` local property of the thread that submits
it. A streaming query sets it on its thread before each batch (the query's name, id, run id and
batch), and the operator's jobs run on that thread (py4j pins the ``foreachBatch`` callback's JVM
calls to it). :class:`BatchJobs` puts the operator's own line in front of the engine's text for
the jobs of one batch, and gives the engine's text back when the batch ends, also when it fails:

* before the state tasks' job: ``DSTL operator 'name', batch N: state tasks (P partitions from
  checkpoint B)``;
* after it, for the jobs of the sink and of the late-rows sink: what the tasks did (rows,
  restores, materializations, segments, the checkpoint written), known only then.

A job's description is fixed when it is submitted, so the state tasks' job cannot carry the
restores and materializations it is about to do; the jobs after it do.

Only the description is touched: the job group (``spark.jobGroup.id``, the query's run id),
through which ``query.stop()`` cancels the batch's jobs, and ``spark.job.interruptOnCancel`` stay
as the engine set them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import TracebackType
from typing import Any

__all__ = ["DESCRIPTION", "BatchJobs", "outcome_label", "tasks_label"]

logger = logging.getLogger(__name__)

#: The local property Spark reads a job's description from (``SparkContext.setJobDescription``).
DESCRIPTION = "spark.job.description"


class BatchJobs:
    """Labels the Spark jobs of one batch (a context manager; see the module docstring).

    Args:
        sc: the batch session's ``SparkContext``.
        operator, batch_id: named in every label.
    """

    def __init__(self, sc: Any, operator: str, batch_id: int) -> None:
        self._sc = sc
        self._prefix = f"DSTL operator {operator!r}, batch {batch_id}"
        self._previous: str | None = None

    def __enter__(self) -> BatchJobs:
        value = self._sc.getLocalProperty(DESCRIPTION)
        self._previous = None if value is None else str(value)
        return self

    def label(self, what: str) -> str:
        """Describe the jobs submitted from now on as ``what`` (before the engine's text);
        returns the description."""
        text = f"{self._prefix}: {what}"
        if self._previous:
            text = f"{text}\n{self._previous}"
        self._sc.setLocalProperty(DESCRIPTION, text)
        return text

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        from py4j.protocol import Py4JError

        try:
            self._sc.setLocalProperty(DESCRIPTION, self._previous)
        except Py4JError as err:
            # a label is cosmetic: it must neither fail a committed batch nor hide the error of
            # a failed one (the session may be going away)
            logger.warning("%s: could not restore the job description: %r", self._prefix, err)


def tasks_label(partitions: int, base_checkpoint: int, initial_state: bool,
                tasks: int | None = None) -> str:
    """The state tasks' job: how many partitions (in how many tasks, when fewer), from which
    checkpoint."""
    base = f"checkpoint {base_checkpoint}" if base_checkpoint >= 0 else "no checkpoint"
    extra = ", with the initial state" if initial_state else ""
    grouped = f" in {tasks} tasks" if tasks is not None and tasks < partitions else ""
    return f"state tasks ({partitions} partitions{grouped} from {base}{extra})"


def outcome_label(checkpoint_id: int, reports: Sequence[Any], completed: bool) -> str:
    """The jobs after the state tasks (sinks): what the tasks did, from their reports."""
    rows_in = sum(r.rows_in for r in reports)
    restores = sum(1 for r in reports if r.slot.access in ("restore", "rescale"))
    materializations = sum(1 for r in reports if r.snapshot is not None)
    segments = len({k for r in reports for k in r.segment_keys})
    state = "written" if completed else "not complete"
    return (f"sink ({rows_in} rows in; {restores} restores, {materializations} "
            f"materializations, {segments} segments; checkpoint {checkpoint_id} {state})")
