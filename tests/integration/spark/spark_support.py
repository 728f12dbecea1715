"""A shared local SparkSession for the Spark tests (starting one costs 10-20 s on 2 cores)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from support.worker_path import start_session, worker_pythonpath


def new_session(name: str, master: str = "local[2,2]", conf: dict[str, str] | None = None) -> Any:
    """``local[2,2]``: 2 cores and up to 2 attempts per task, so a killed task is retried.
    ``conf``: more Spark conf (static ones take effect only if no session is active)."""
    from pyspark.sql import SparkSession

    # workers must run this interpreter (the venv), not whatever `python3` is on PATH, and must
    # import the test modules that define processors (cloudpickle ships classes by reference)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = worker_pythonpath()
    return start_session(SparkSession.builder.master(master).appName(name), conf or {})


def _alive(session: Any) -> bool:
    from pyspark import SparkContext

    return SparkContext._active_spark_context is session.sparkContext


@pytest.fixture
def spark(_module_spark_sessions: list[Any]) -> Any:
    """The process's shared session (kept by ``_shared_spark_sessions`` in tests/conftest.py,
    handed to each module as a fresh one), started again if a test stopped it: a test that
    wants a fresh session calls :func:`new_session`, whose ``getOrCreate`` returns this one,
    and stops it; the tests after it must not get a stopped session (that made them depend on
    their order)."""
    if not _module_spark_sessions or not _alive(_module_spark_sessions[-1]):
        session = new_session("dstl-tests")
        session._dstl_tests_conf = dict(session.conf.getAll)  # what each module starts from
        _module_spark_sessions.append(session)
    return _module_spark_sessions[-1]


EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def load_example(name: str) -> ModuleType:
    """Import examples/<name>.py as a script would see it (examples/ on ``sys.path`` for its
    ``_harness``); its classes travel to the workers by value (examples/ is not on the
    workers' path)."""
    from pyspark import cloudpickle

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"dstl_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    cloudpickle.register_pickle_by_value(mod)
    return mod
