"""The ``PYTHONPATH`` a Spark test's Python workers need: the folders of the test modules that
define processors (cloudpickle ships a class by reference, so a worker imports its module),
then whatever ``PYTHONPATH`` already holds."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def worker_pythonpath() -> str:
    """``tests/integration/spark``, ``tests``, then the current ``PYTHONPATH``."""
    paths = [str(TESTS / "integration" / "spark"), str(TESTS), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in paths if p)
