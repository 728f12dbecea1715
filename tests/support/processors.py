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
