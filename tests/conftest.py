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


@pytest.fixture(scope="session")
def _shared_spark_sessions() -> Iterator[list[Any]]:
    """The SparkSessions that ``spark_support.spark`` started in this process, the last one
    alive: one session serves every module that takes the ``spark`` fixture (starting a session,
    its Python workers and DSTL's agent costs 20-60 s on 2 cores, once per process instead of
    once per module); stopped at the end."""
    sessions: list[Any] = []
    yield sessions
    _stop_sessions(sessions)


@pytest.fixture(scope="module", autouse=True)
def _module_spark_sessions(request: pytest.FixtureRequest,
                           _shared_spark_sessions: list[Any]) -> Iterator[list[Any]]:
    """Before each module: a module whose tests take the ``spark`` fixture gets the shared
    session as a fresh one (no active stream, nothing cached, the runtime conf as it started);
    a module of Spark tests that do not take it starts sessions of its own (another master,
    static conf, a Connect client), so the shared one is stopped first."""
    items = [i for i in request.session.items if getattr(i, "module", None) is request.module]
    if any("spark" in getattr(i, "fixturenames", ()) for i in items):
        _reset_shared(_shared_spark_sessions)
    elif any(i.get_closest_marker("spark") is not None for i in items):
        _stop_sessions(_shared_spark_sessions)
    yield _shared_spark_sessions


def _stop_sessions(sessions: list[Any]) -> None:
    if not sessions:
        return
    from pyspark import SparkContext

    for s in sessions:
        if SparkContext._active_spark_context is s.sparkContext:
            s.stop()
    sessions.clear()


def _reset_shared(sessions: list[Any]) -> None:
    """The shared session as the previous module found it: its streams stopped, its cache
    dropped, runtime conf keys set since it started unset and changed ones set back."""
    from pyspark import SparkContext

    if not sessions or SparkContext._active_spark_context is not sessions[-1].sparkContext:
        return
    s = sessions[-1]
    for q in s.streams.active:
        q.stop()
    s.catalog.clearCache()
    start: dict[str, str] = getattr(s, "_dstl_tests_conf", None) or {}
    now = s.conf.getAll
    for k in now.keys() - start.keys():
        s.conf.unset(k)
    for k, v in start.items():
        if now.get(k) != v:
            s.conf.set(k, v)
