"""Processors the Spark tests share (workers import them by reference: ``tests/`` is on their
path, see ``tests/integration/spark_support.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dstl.spark import StatefulProcessor


class Count(StatefulProcessor):
    """A running count per key: emits ``{"key", "count"}`` once per key per batch."""

    def init(self, handle: Any) -> None:
        self.count = handle.get_value_state("count")

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        c = (self.count.get() or 0) + sum(1 for _ in rows)
        self.count.update(c)
        yield {"key": key, "count": c}


class CrashOnce(Count):
    """:class:`Count` whose first call in micro-batch 1 on Spark task 1 kills its Python worker
    (Spark retries the task), once: ``flag`` (set on a subclass made per test) is the file that
    records it."""

    flag = ""

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        import os
        from pathlib import Path

        from pyspark import TaskContext

        ctx = TaskContext.get()
        if self.flag and ctx is not None and ctx.partitionId() == 1 \
                and ctx.getLocalProperty("streaming.sql.batchId") == "1" \
                and not os.path.exists(self.flag):
            Path(self.flag).write_text("killed")
            os._exit(137)
        yield from super().handle_input_rows(key, rows)
