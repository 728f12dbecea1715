"""Partition tasks in a process of their own (another Python worker of the executor): one that
stops in the middle of its batch until told to go on, the zombie attempt of
``test_spark_task.py::test_two_attempts_of_a_partition_never_interleave_on_one_table`` (an
executor's task that keeps running after the driver re-ran it elsewhere, on the table of a
``local_dir`` both executors share), and one that runs its batch straight through
(:func:`run_elsewhere`)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from dstl.spark import StatefulProcessor
from dstl.spark.config import OperatorConfig, TaskInput
from dstl.spark.report import REPORT_COLUMN
from dstl.spark.task import run_partition

#: (started file, go file) in the gated process; None elsewhere (the processor does not wait)
GATE: tuple[str, str] | None = None


class GatedCount(StatefulProcessor):
    """Counts rows per key; in the gated process, waits inside the batch (its LMDB write
    transaction open) until the go file exists."""

    def init(self, handle: Any) -> None:
        self.count = handle.get_value_state("count")

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        if GATE is not None:
            started, go = GATE
            open(started, "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.05)  # waiting for the test's signal from another process
        c = (self.count.get() or 0) + sum(1 for _ in rows)
        self.count.update(c)
        yield {"key": key, "count": c}


def run_gated(cfg: OperatorConfig, task_input: TaskInput, keys: list[str], started: str,
              go: str, result: str) -> None:
    """Run one task of partition 0 with the gate set; write its output rows to ``result``."""
    global GATE
    GATE = (started, go)
    out = {}
    for rb in run_partition(cfg, task_input, iter([pa.RecordBatch.from_pydict({"key": keys})]),
                            partition=0):
        out.update({r["key"]: r["count"] for r in rb.to_pylist() if r[REPORT_COLUMN] is None})
    with open(result, "w") as f:
        json.dump(out, f)


def run_elsewhere(cfg: OperatorConfig, task_input: TaskInput, keys: list[str],
                  result: str) -> None:
    """Run one task of partition 0; write its output rows and report (JSON) to ``result``."""
    out, report = {}, None
    for rb in run_partition(cfg, task_input, iter([pa.RecordBatch.from_pydict({"key": keys})]),
                            partition=0):
        for r in rb.to_pylist():
            if r[REPORT_COLUMN] is None:
                out[r["key"]] = r["count"]
            else:
                report = r[REPORT_COLUMN]
    with open(result, "w") as f:
        json.dump({"out": out, "report": report}, f)
