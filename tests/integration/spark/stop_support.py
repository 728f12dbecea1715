"""Processors for the stop tests: a count that sleeps so that a batch is still running when the
test stops the query."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from test_spark_operator import Count


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
