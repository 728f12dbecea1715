"""Shared test configuration: Hypothesis profiles, the deep switch, and leak checks.

Every DSTL thread is named ``dstl-...``; the autouse ``no_dstl_thread_leaks`` fixture fails a test
that leaves one running (guarantee G8).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))  # make tests/support importable as `support`
# One MiniDFSCluster per worker process for every module that uses it: a fixture defined here
# is one definition (imported into each module, it would be one per module, 20 s each).
from support.minidfs import hdfs_cluster  # noqa: F401

# gcsfs reads this when imported: its "extended" class probes a gRPC API that the GCS emulator
# of the contract suite lacks (see tests/support/store_emulators.py).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

settings.register_profile("dev", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=100, deadline=None, derandomize=True,
                          stateful_step_count=50, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=2000, deadline=None, stateful_step_count=200,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

DEEP = os.environ.get("DSTL_DEEP") == "1"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--deep", action="store_true", default=False,
                     help="run the heavier test variants (same as DSTL_DEEP=1)")


def pytest_configure(config: pytest.Config) -> None:
    global DEEP
    if config.getoption("--deep"):
        DEEP = True
        os.environ["DSTL_DEEP"] = "1"


def _dstl_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("dstl-") and t.is_alive()}


@pytest.fixture(autouse=True)
def no_dstl_thread_leaks() -> Iterator[None]:
    before = _dstl_threads()
    yield
    deadline = time.monotonic() + 5.0
    leaked = _dstl_threads() - before
    while leaked and time.monotonic() < deadline:
        for t in leaked:
            t.join(timeout=0.1)
        leaked = _dstl_threads() - before
    assert not leaked, f"threads left running after the test: {sorted(t.name for t in leaked)}"


@pytest.fixture(scope="module")
def _module_spark_sessions() -> Iterator[list[Any]]:
    """The SparkSessions that ``spark_support.spark`` started in one test module, stopped when
    the module ends (here so that every test module sees it without importing it)."""
    sessions: list[Any] = []
    yield sessions
    for s in sessions:
        from pyspark import SparkContext

        if SparkContext._active_spark_context is s.sparkContext:
            s.stop()
