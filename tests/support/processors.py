"""Processors the Spark tests share (workers import them by reference: ``tests/`` is on their
path, see ``tests/integration/spark/spark_support.py``)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
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


class Poison(Count):
    """:class:`Count` that raises ``ValueError`` for a batch holding the key ``poison``."""

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        rows = list(rows)
        if any(r["key"] == "poison" for r in rows):
            raise ValueError("processor refused the poison key")
        yield from super().handle_input_rows(key, iter(rows))


class SlowCount(Count):
    """A count that sleeps ``DSTL_TEST_SLOW_S`` seconds per key, after writing
    ``<DSTL_TEST_SLOW_DIR>/running-<pid>`` (the test waits for it before it stops the query)."""

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        flag_dir = os.environ.get("DSTL_TEST_SLOW_DIR", "")
        if flag_dir:
            Path(flag_dir, f"running-{os.getpid()}").write_text(str(key))
        time.sleep(float(os.environ.get("DSTL_TEST_SLOW_S", "0")))
        yield from super().handle_input_rows(key, rows)


class CrashOnce(Count):
    """:class:`Count` whose first call in micro-batch 1 on Spark task 1 kills its Python worker
    (Spark retries the task), once: ``flag`` (set on a subclass made per test) is the file that
    records it."""

    flag = ""

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if self.flag and ctx is not None and ctx.partitionId() == 1 \
                and ctx.getLocalProperty("streaming.sql.batchId") == "1" \
                and not os.path.exists(self.flag):
            Path(self.flag).write_text("killed")
            os._exit(137)
        yield from super().handle_input_rows(key, rows)


class TypedTotal(StatefulProcessor):
    """A running count per key in a value state of declared type ``schema`` (a struct with
    ``n``; with a ``last`` field it also keeps the key's previous batch number): emits
    ``{"key", "count", "last"}`` with the ``last`` stored before this batch (``None`` for a
    value converted from a type without ``last``). Subclasses set ``schema``."""

    schema = "n int"

    def init(self, handle: Any) -> None:
        self.total = handle.get_value_state("total", schema=self.schema)
        self.has_last = "last" in self.schema

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        old = self.total.get() or {"n": 0}
        c = old["n"] + sum(1 for _ in rows)
        new: dict[str, Any] = {"n": c}
        if self.has_last:
            new["last"] = f"seen {c}"
        self.total.update(new)
        yield {"key": key, "count": c, "last": old.get("last")}


class TypedTotalWider(TypedTotal):
    """:class:`TypedTotal` after a compatible change: ``n`` widened to long, ``last`` added."""

    schema = "n long, last string"


class TypedTotalAsString(TypedTotal):
    """:class:`TypedTotal` after an incompatible change: ``n`` became a string."""

    schema = "n string"
